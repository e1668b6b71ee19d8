# ps-compose: one command for each thing a user does. `make help` lists them.
PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
# The CPU build of torch for the test venv; on a machine without this file on
# disk, pip takes it from PyPI. Override to pin another build.
TORCH   ?= torch==2.13.0
CONFIG  ?= configs/default.yaml
WORKERS ?=
ORCH    := $(PY) -m orchestrator
CFG     := -c $(CONFIG) $(if $(WORKERS),--workers $(WORKERS))

.DEFAULT_GOAL := help
.PHONY: help setup host-setup test test-fast render local build up logs status down smoke engine clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

# Two stamps: the host venv (orchestrator only, no torch) is enough for
# `make up`; the dev venv adds the app, torch and the test tools.
$(VENV)/.host: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[orchestrator]'
	touch $@

$(VENV)/.dev: $(VENV)/.host
	$(VENV)/bin/pip install -q '$(TORCH)'
	$(VENV)/bin/pip install -q -e '.[app,orchestrator,dev]'
	touch $@

host-setup: $(VENV)/.host ## venv for running the cluster (no torch)
setup: $(VENV)/.dev ## venv for the app, local runs and the tests

test: setup ## the whole test suite, containers included
	$(PY) -m pytest

test-fast: setup ## unit tests only (no processes, no containers)
	$(PY) -m pytest -m 'not slow'

render: host-setup ## write compose.yaml from CONFIG (and WORKERS)
	$(ORCH) render $(CFG) -o compose.yaml

local: setup ## PS + workers as local processes (CONFIG, WORKERS)
	$(ORCH) local $(CFG)

# The cluster in containers (orchestrator/cluster.py). logs, status and down act
# on the cluster `up` started last, unless CONFIG or WORKERS is given.
LAST    := $(if $(filter file,$(origin CONFIG)),,-c $(CONFIG)) $(if $(WORKERS),--workers $(WORKERS))

engine: ## install and start Debian's Docker engine if missing (root or sudo)
	.ci/engine.sh

build: host-setup ## build CONFIG's image (Docker SDK, progress streamed)
	$(ORCH) build $(CFG)

up: host-setup ## render, build if missing, start PS + WORKERS workers detached
	$(ORCH) up $(CFG)

logs: host-setup ## follow every service's log, prefixed by service
	$(ORCH) logs $(LAST)

status: host-setup ## one line per service: state, exit code, step, loss
	$(ORCH) status $(LAST)

down: host-setup ## stop and remove the cluster; checkpoints and metrics stay
	$(ORCH) down $(LAST)

smoke: host-setup ## cpu-smoke, 2 workers, in containers: accuracy >= 0.90, all exit 0
	$(ORCH) smoke
