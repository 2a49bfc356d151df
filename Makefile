# gpupool: every target installs what it needs and is safe to run twice, from any folder, as
# root or as an ordinary user.
#
# User code (servers, jobs, and the tests' hubs run as an unprivileged account) runs from the
# *runtime*. As an ordinary user that is .venv itself: user code runs as you. As root it runs
# as unprivileged accounts, which may not be able to enter this checkout (a clone under /root or
# in a 0700 folder), so the runtime is a venv outside it, under /var/cache/gpupool/ (one per
# checkout), with gpupool installed from a wheel of this checkout (scripts/build-runtime), and
# made from a system Python (pyenv's lives under /root). No folder's permissions are changed.
ROOT   := $(filter 0,$(shell id -u))
PYTHON ?= $(if $(and $(ROOT),$(wildcard /usr/bin/python3)),/usr/bin/python3,python3)
VENV   := .venv
BIN    := $(VENV)/bin
DEMO_STAMP := $(VENV)/.demo
STAMP  := $(VENV)/.installed
RUNTIMES := /var/cache/gpupool/$(shell printf %s '$(CURDIR)' | sha256sum | cut -c1-16)
# (The built extension under gpupool_lab/labextension is not listed: a rebuild renames its files
# while make runs; the demo's stamp, which the runtime also needs, stands for it.)
PACKAGE_SRC := pyproject.toml $(shell find hub spawner labextension/gpupool_lab -type f \
  -not -path '*/__pycache__/*' -not -path 'labextension/gpupool_lab/labextension/*' 2>/dev/null)
# The runtime's stamp (as root; nothing to build otherwise) and its Python.
RUNTIME := $(if $(ROOT),$(RUNTIMES)/venv/.installed)
RUNTIME_PYTHON := $(if $(ROOT),$(RUNTIMES)/venv/bin/python,$(VENV)/bin/python)
TOOLS  := .venv-tools/bin
PIP    := $(BIN)/python -m pip

CHP    := node_modules/.bin/configurable-http-proxy
JLPM   := ../$(BIN)/jlpm
LABEXT := labextension/gpupool_lab/labextension/package.json
LABSRC := $(shell find labextension/src labextension/style -type f 2>/dev/null) \
          labextension/package.json labextension/yarn.lock labextension/tsconfig.json
YARN_CACHE_FOLDER ?= $(CURDIR)/labextension/.yarn-cache
export YARN_CACHE_FOLDER
export PATH := $(CURDIR)/$(BIN):$(PATH)

# `make run` installs quietly: everything the package managers print goes to this log.
INSTALL_LOG := .run/install.log
HUB_LOG     := .run/hub.log

.PHONY: install install-demo run run-slurm test test-fast test-jh5 test-clone conformance \
  conformance-baseline lint format bench clean chromium postgresql slurm node-check preflight

# What the tests need; `install-demo` is what `make run` needs (no test tools, no browser).
install: install-demo $(STAMP) chromium postgresql slurm $(TOOLS)/nca
install-demo: $(NODE_CHECK) $(DEMO_STAMP) $(CHP) $(RUNTIME)

# Manifest checkers the chart tests run (network-config-analyzer, checkov), in a venv of their
# own: their pins (PyYAML, networkx, packaging) clash with the hub's.
$(TOOLS)/nca:
	$(PYTHON) -m venv .venv-tools
	$(TOOLS)/python -m pip install --quiet "checkov==3.3.30" "network-config-analyzer==1.9.2"

# Node.js builds the extension and runs configurable-http-proxy: say which one is needed, once.
# `make run` checks it first and runs its install steps with GPUPOOL_NODE_CHECKED=1, which drops
# the check from them (each step is a make of its own: its warning would print again).
NODE_CHECK := $(if $(GPUPOOL_NODE_CHECKED),,node-check)
node-check:
	@scripts/check-node

# 1. a venv with JupyterLab (for jlpm) and the build backend; 2. the JupyterLab extension,
# built with jlpm; 3. the package itself, editable, finding the built extension in place.
$(VENV)/.base: constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt 'jupyterlab>=4.6,<5' 'hatchling>=1.21' editables \
	  'hatch-jupyter-builder>=0.9'
	touch $@

$(LABEXT): $(VENV)/.base $(LABSRC) | $(NODE_CHECK)
	cd labextension && $(JLPM) install --immutable && $(JLPM) build:prod
	touch $@

# The demo's hub: as root its servers and jobs run from the runtime, so the hub's venv needs no
# notebook side (PyTorch and the rest come with the tests' extras).
$(DEMO_STAMP): pyproject.toml constraints.txt $(LABEXT)
	$(PIP) install --quiet -c constraints.txt --no-build-isolation -e '.[$(if $(ROOT),hub,hub,lab)]'
	touch $@

$(STAMP): $(DEMO_STAMP)
	$(PIP) install --quiet -c constraints.txt --no-build-isolation -e '.[hub,lab,test]'
	touch $@

# The runtime, as root (see the top): rebuilt when the package's sources change.
$(RUNTIMES)/venv/.installed: $(DEMO_STAMP) $(PACKAGE_SRC) constraints.txt
	scripts/build-runtime $(VENV) $(RUNTIMES)/venv constraints.txt
	$(call runtime-postgresql,$(VENV),$(RUNTIMES)/venv,-c constraints.txt)

# The production database's driver (the `postgresql` extra) in a runtime too, from the wheel
# scripts/build-runtime just built, so that a hub run from it opens a PostgreSQL URL: $(1) the
# hub's venv, $(2) the runtime, $(3) its constraints. A failure leaves the runtime to rebuild.
runtime-postgresql = umask 022 && $(2)/bin/python -m pip install --quiet $(3) \
  "$$(echo $(1)/gpupool-wheel/jupyterhub_gpupool-*.whl)[postgresql]" || { rm -f $(2)/.installed; \
  exit 1; }

# The second supported JupyterHub: the one the hub image of the z2jh chart release we depend on
# ships (constraints-jh5.txt pins it). The same package, editable, with the same constraints,
# in a venv of its own; `make test-jh5` runs the tests that import JupyterHub against it.
JH5       := .venv-jh5
JH5_BIN   := $(JH5)/bin
JH5_STAMP := $(JH5)/.installed
JH5_PIP   := $(JH5_BIN)/python -m pip -q
JH5_RUNTIME := $(if $(ROOT),$(RUNTIMES)/venv-jh5/.installed)

$(JH5_STAMP): pyproject.toml constraints.txt constraints-jh5.txt $(LABEXT)
	test -x $(JH5_BIN)/python || $(PYTHON) -m venv $(JH5)
	$(JH5_PIP) install --upgrade pip
	$(JH5_PIP) install -c constraints.txt -c constraints-jh5.txt 'jupyterlab>=4.6,<5' \
	  'hatchling>=1.21' editables 'hatch-jupyter-builder>=0.9'
	$(JH5_PIP) install -c constraints.txt -c constraints-jh5.txt --no-build-isolation \
	  -e '.[hub,lab,test]'
	touch $@

$(RUNTIMES)/venv-jh5/.installed: $(JH5_STAMP) $(PACKAGE_SRC) constraints.txt constraints-jh5.txt
	scripts/build-runtime $(JH5) $(RUNTIMES)/venv-jh5 constraints.txt constraints-jh5.txt
	$(call runtime-postgresql,$(JH5),$(RUNTIMES)/venv-jh5,-c constraints.txt -c constraints-jh5.txt)

# Browser tests drive Debian's Chromium (never a downloaded browser): installed as root; an
# ordinary user without it gets the browser tests skipped, saying so.
chromium:
	@command -v chromium >/dev/null || { if [ -n "$(ROOT)" ]; then apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium || { echo "gpupool: \
	  apt-get could not install Debian's chromium (above); the browser tests need it" >&2; \
	  exit 1; }; else echo "gpupool: Debian's chromium is not installed and only root can \
	  install it (apt-get install chromium): the browser tests will be skipped"; fi; }

# The store's tests also run against a real PostgreSQL server (tests/databases.py), Debian's
# (initdb and pg_ctl): installed as root; an ordinary user without it gets those tests skipped,
# saying so. As root they must run: a server that is missing or does not start fails them.
postgresql:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { if [ -n "$(ROOT)" ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql || { \
	  echo "gpupool: apt-get could not install Debian's postgresql (above); the store's tests \
	  need it" >&2; exit 1; }; else echo "gpupool: Debian's postgresql is not installed and only \
	  root can install it (apt-get install postgresql): the PostgreSQL tests will be skipped"; fi; }

# The Slurm tests run real daemons (tests/slurm_cluster.py): Debian's Slurm 22.05 with munge,
# slurmrestd and slurmdbd with MariaDB for the accounts and QOS tests; installed as root (no
# service is started: the tests start their own in a temporary folder); an ordinary user without
# them gets the Slurm tests skipped, saying so. As root they must run.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge slurmrestd slurm-wlm-jwt-plugin slurmdbd \
  mariadb-server
slurm:
	@{ command -v slurmctld && command -v slurmdbd && command -v mariadbd && command -v \
	  slurmrestd; } >/dev/null 2>&1 || { if [ -n "$(ROOT)" ]; then apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SLURM_PACKAGES) || { echo \
	  "gpupool: apt-get could not install Debian's Slurm (above); the Slurm tests need it" >&2; \
	  exit 1; }; else echo "gpupool: Debian's Slurm is not installed and only root can install \
	  it (apt-get install $(SLURM_PACKAGES)): the Slurm tests will be skipped"; fi; }

$(CHP): | $(NODE_CHECK)
	npm install --no-save --no-package-lock --no-audit --no-fund configurable-http-proxy@5.3.0

# `make run`'s install: what install-demo makes, one step at a time, each a line on the terminal
# ("up to date" when there is nothing to do) and a make of its own whose output goes to
# $(INSTALL_LOG); a failed step shows the log's end. The steps are recursive makes (`+`): `make -n
# run` asks each whether it is up to date and prints, on the terminal, what it would run.
DEMO_STEPS := $(VENV)/.base $(LABEXT) $(DEMO_STAMP) $(CHP) $(RUNTIME)
DRY_RUN := $(findstring n,$(firstword -$(MAKEFLAGS)))
STEP_MAKE = $(MAKE) --no-print-directory GPUPOOL_NODE_CHECKED=1
# $(1) the step's number, $(2) its name, $(3) its target.
demo-step = printf 'gpupool: [%s/%s] %s' $(1) $(words $(DEMO_STEPS)) '$(2)'; \
  if $(STEP_MAKE) -q $(3) >/dev/null 2>&1; then echo ': up to date'; else echo ' ...'; \
  $(STEP_MAKE) $(3) $(if $(DRY_RUN),,>>$(INSTALL_LOG) 2>&1) || { echo "gpupool: [$(1)/$(words \
  $(DEMO_STEPS))] $(2) failed; the end of $(CURDIR)/$(INSTALL_LOG):"; tail -n 25 $(INSTALL_LOG); \
  exit 1; }; fi

# What `make run` and `make run-slurm` install first: the ports are free, then each step.
define demo-install
@scripts/run-hub --check-ports
@mkdir -p -m 700 .run && : >$(INSTALL_LOG) && \
  echo "gpupool: installing what is missing (details: $(INSTALL_LOG))"
@+$(call demo-step,1,venv and JupyterLab,$(VENV)/.base)
@+$(call demo-step,2,the JupyterLab extension (jlpm build),$(LABEXT))
@+$(call demo-step,3,the gpupool package (editable),$(DEMO_STAMP))
@+$(call demo-step,4,configurable-http-proxy,$(CHP))
$(if $(RUNTIME),@+$(call demo-step,5,the runtime for user code,$(RUNTIME)))
endef

# The demo hub on http://127.0.0.1:8000 (Ctrl-C stops the hub, its proxy and its servers). As
# root, servers and jobs run as the unprivileged account gpupool-demo, created here. The install
# (install-demo, by step, above) prints into $(INSTALL_LOG), the hub into $(HUB_LOG); the
# terminal gets a line per install step, the hub's warnings and, last, its banner: the address,
# the demo password, the admin-password file. Node.js is checked once, here.
run: node-check
	$(demo-install)
	@scripts/demo-account gpupool-demo $(RUNTIME_PYTHON)
	@echo "gpupool: starting the hub (log: $(HUB_LOG); Ctrl-C stops it, its proxy and servers)"
	@$(BIN)/python scripts/run-hub $(HUB_LOG) $(BIN)/jupyterhub -f jupyterhub_config.py

# The same demo hub on a Slurm cluster started on this machine (root only: Slurm's daemons, and each
# user's server and jobs run as Slurm jobs of their own unix account; docs/slurm.md, section 8).
run-slurm: node-check
	$(demo-install)
	@$(MAKE) --no-print-directory slurm
	@echo "gpupool: starting a Slurm cluster and the hub (log: $(HUB_LOG); Ctrl-C stops both)"
	@$(BIN)/python -m gpupool.slurm.demo $(HUB_LOG) $(BIN)/jupyterhub -f jupyterhub_config.py

# First what every test needs (tests/preflight.py): a failure stops here, once, saying what to do.
# JupyterHub's own tests and the JupyterHub 5 run go side by side (each prints when it is done).
# Last, the skipped tests of all its pytest runs, counted by reason (tests/skips.py).
# The installs run side by side (the venvs, the runtimes, the tools are independent).
SKIPS := $(CURDIR)/.pytest_cache/gpupool-skips
# pytest runs test modules side by side (pytest-xdist), a whole module per worker so that its
# fixtures (a hub, its servers) are made once: most of a test's time is spent waiting on them.
PARALLEL ?= -n $(shell nproc) --dist loadfile
test:
	@$(MAKE) --no-print-directory -j$(shell nproc) install $(JH5_STAMP) $(JH5_RUNTIME)
	$(BIN)/python -m tests.preflight
	mkdir -p .pytest_cache && rm -f $(SKIPS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy && $(BIN)/mypy --strict -p gpupool.core
	cd labextension && $(JLPM) lint:check && $(JLPM) test
	GPUPOOL_SKIPS=$(SKIPS) $(BIN)/python -m pytest -q --durations=25 $(PARALLEL)
	GPUPOOL_SKIPS=$(SKIPS) $(MAKE) --no-print-directory -j2 --output-sync=target conformance test-jh5
	@$(BIN)/python -m tests.skips $(SKIPS)

# JupyterHub's own tests (from the installed JupyterHub) with gpupool's spawner and setup(c) in
# place of the mock spawner's base (tests/conformance/plugin.py); bounded: 15 minutes, 2 per test.
CONFORMANCE_TESTS := --pyargs jupyterhub.tests.test_spawner jupyterhub.tests.test_api \
  jupyterhub.tests.test_named_servers jupyterhub.tests.test_pages \
  -k "not test_pages or test_spawn or test_server_not_running or test_pre_spawn or test_malformed_form"
CONFORMANCE := PATH=$(CURDIR)/node_modules/.bin:$$PATH timeout 900 $(BIN)/python -m pytest -q \
  -c tests/conformance/pytest.ini --rootdir $(CURDIR) $(CONFORMANCE_TESTS)

# The tests that import JupyterHub, against the z2jh chart's JupyterHub (.venv-jh5): the hub's
# (tests/hub: real hubs, servers and jobs), then the quick ones of the hub side, the spawners and
# the Kubernetes path (tests/adapters, tests/deploy/test_kube_*.py; their slow modules run real
# torchrun jobs or Helm and do not touch JupyterHub), and the image pins. Its own PATH first, so
# the hub, the single-user servers and the jobs all run that JupyterHub, never the main venv's.
JH5_PYTEST := PATH=$(CURDIR)/$(JH5_BIN):$(CURDIR)/node_modules/.bin:$$PATH $(JH5_BIN)/python -m \
  pytest -q -p no:cacheprovider
# Left out of the JupyterHub 5 run: modules that test gpupool's own logic behind its API (fuzzing,
# bad input, a broken pool database, MIG on demand, shares, metrics, the device watch), the same
# whichever JupyterHub serves it; the main run covers them.
JH5_SKIP := test_api_fuzz test_bad_input test_broken_database test_mig_on_demand test_shares \
  test_metrics test_device_watch test_store_faults
test-jh5: install $(JH5_STAMP) $(JH5_RUNTIME)
	$(JH5_PYTEST) --durations=15 $(PARALLEL) tests/hub \
	  $(foreach m,$(JH5_SKIP),--ignore=tests/hub/$(m).py)
	$(JH5_PYTEST) -m "not slow" tests/adapters $(wildcard tests/deploy/test_kube_*.py) \
	  tests/deploy/test_images.py

conformance: install
	$(CONFORMANCE)

# The same selection with JupyterHub's unmodified mock spawner (what the deviations are read against).
conformance-baseline: install
	GPUPOOL_CONFORMANCE_BASELINE=1 $(CONFORMANCE)

# `make test` without the tests marked slow (real hubs, the browser, real torchrun jobs, Helm
# renders; tests/conftest.py marks them by folder and file).
test-fast: install
	$(BIN)/python -m tests.preflight
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy && $(BIN)/mypy --strict -p gpupool.core
	cd labextension && $(JLPM) lint:check && $(JLPM) test
	$(BIN)/python -m pytest -q -m "not slow"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy && $(BIN)/mypy --strict -p gpupool.core
	cd labextension && $(JLPM) lint:check

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install
	$(BIN)/python -m benchmarks.replay --policy all
	$(BIN)/python -m benchmarks.replay --policy all --churn 2000 --seed 1
	$(BIN)/python -m benchmarks.replay --model sharing --policy all
	$(BIN)/python -m benchmarks.replay --model sharing --policy all --churn 2000 --seed 1
	$(BIN)/python -m benchmarks.refusals
	$(BIN)/python -m benchmarks.allocator
	$(BIN)/python -m benchmarks.node_events
	$(BIN)/python -m benchmarks.spawn
	$(BIN)/python -m benchmarks.jobs
	$(BIN)/python -m benchmarks.operations

# Regenerate the Helm chart's GPU-equivalents table and the offer and team parts of its
# values.schema.json after changing gpupool.core.mig or gpupool.declarations.
helm-table: install
	$(BIN)/python scripts/helm-gpu-equivalents
	$(BIN)/python scripts/helm-values-schema

clean:
	rm -rf $(RUNTIMES) $(VENV) $(JH5) .venv-tools node_modules .run .pytest_cache .mypy_cache \
	  .ruff_cache \
	  .hypothesis \
	  labextension/node_modules labextension/lib labextension/gpupool_lab/labextension
