# gpupool: every target installs what it needs and is safe to run twice.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip

CHP    := node_modules/.bin/configurable-http-proxy

.PHONY: install run test lint format bench clean

install: $(STAMP) $(CHP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[hub,lab,test]'
	touch $(STAMP)

$(CHP):
	npm install --no-save --no-package-lock --no-audit --no-fund configurable-http-proxy@5.3.0

# The demo hub on http://127.0.0.1:8000 (Ctrl-C stops the hub, its proxy and its servers).
run: install
	$(BIN)/jupyterhub -f jupyterhub_config.py

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
	$(BIN)/python -m benchmarks.spawn
	$(BIN)/python -m benchmarks.jobs

clean:
	rm -rf $(VENV) node_modules .run .pytest_cache .mypy_cache .ruff_cache .hypothesis
