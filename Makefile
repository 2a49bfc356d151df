# gpupool: every target installs what it needs and is safe to run twice.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip

.PHONY: install run test lint format bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[hub,lab,test]'
	touch $(STAMP)

run: install
	@echo "make run: the hub arrives with the spawner issue (#3); the pool core is ready:"
	$(BIN)/python -m gpupool.inspect

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install
	$(BIN)/python -m benchmarks.replay --policy all
	$(BIN)/python -m benchmarks.replay --policy all --churn 2000 --seed 1
	$(BIN)/python -m benchmarks.allocator

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
