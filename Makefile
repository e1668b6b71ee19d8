# ps-compose: one command for each thing a user does. `make help` lists them.
PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
CONFIG  ?= configs/default.yaml
WORKERS ?=
STRATEGY ?=
ORCH    := $(PY) -m orchestrator
# The hints a verb prints name the next commands in make's words (`make logs NAME=x`) here, in
# ps-compose's (`ps-compose logs --name x`) where it runs without make (orchestrator/hints.py).
export PSC_VIA_MAKE := 1
# NAME=: the run's name (its compose project or stack, state volume and runs/NAME/) instead of
# the topology's name:, for a second run of one config beside the first. Taken from the command
# line only: WSL sets NAME to the host's name in every shell.
NAME    := $(if $(filter environment%,$(origin NAME)),,$(NAME))
NAMED   := $(if $(NAME),--name $(NAME))
CFG     := -c $(CONFIG) $(if $(WORKERS),--workers $(WORKERS)) $(if $(STRATEGY),--strategy $(STRATEGY)) $(NAMED)
# ARGS="...": more arguments for the verbs that read a topology (render, doctor, build, up, local, check,
# stack-up), after the others: KEY=VALUE overrides of the topology (ARGS="train.lr=0.05 workers.count=3"),
# or a verb's flags (logs, status and runs too: ARGS=--json, ARGS="--tail 20 --timestamps").
ARGS    ?=
# RESUME=1: up, stack-up and local continue the newest unfinished checkpoint (default: a new run at version 0);
# RESUME=RUN_ID: that run (`make runs` lists them), under its own id.
RESUME  ?=
RESUMING := $(if $(filter-out 0,$(RESUME)),--resume$(if $(filter-out 1,$(RESUME)),=$(RESUME)))

.DEFAULT_GOAL := help
.PHONY: help setup host-setup lock clean test test-fast lint render sample-data local build up logs status down scale smoke engine tensorboard export \
        doctor gpu-check stack-up stack-down stack-logs stack-status stack-smoke stack-scale stack-tensorboard stack-export chaos soak check runs

# make help: the names in a column as wide as the longest, each description wrapped to the
# terminal's width (COLUMNS=N sets it; 100 without a terminal); below 30 columns left for the
# descriptions, each goes under its name.
define HELP_AWK
function out(s) { printf "%s%s\n", (first ? sprintf("  make %-" w "s ", name) : pad), s; first = 0 }
{ names[NR] = $$1; texts[NR] = $$2; if (length($$1) > w) w = length($$1) }
END {
	indent = w + 8; avail = cols - indent
	if (avail < 30) { indent = 6; avail = cols - indent; under = 1 }
	if (avail < 20) avail = 20
	pad = sprintf("%" indent "s", "")
	for (i = 1; i <= NR; i++) {
		name = names[i]; first = !under; line = ""
		if (under) printf "  make %s\n", name
		n = split(texts[i], words, " ")
		for (j = 1; j <= n; j++) {
			if (line != "" && length(line) + 1 + length(words[j]) > avail) { out(line); line = words[j] }
			else line = (line == "" ? words[j] : line " " words[j])
		}
		out(line)
	}
}
endef
export HELP_AWK

help: ## list the targets
	@cols=$${COLUMNS:-$$(stty size 2>/dev/null </dev/tty | cut -d' ' -f2)}; \
	grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' -v cols="$${cols:-100}" "$$HELP_AWK"

# Two stamps, each installed from its lock file (requirements/*.txt, `make lock`:
# exact versions and hashes): the host venv (orchestrator only, no torch) is enough
# for `make up`; the dev venv adds the app, the torch + torchvision pair and the
# test tools. --no-deps: a lock holds every package the venv gets. triton (0.9 GB)
# is left out of the locks, as of the offline image: it serves torch.compile's GPU
# kernels, which nothing here uses, and `import torch` does not need it.
# uv installs them (itself installed in .cache/ when a venv is made): the same hash
# checks as pip, on every core, bytecode compiled as pip does; the dev venv took 186 s
# with pip on a 2-core CPU VM, 96 s with uv (docs/dependencies.md). INSTALLER=pip
# uses the venv's own pip: a host whose package index is set in pip's configuration,
# which uv does not read.
UV_VERSION := 0.13.8
UV      := .cache/uv-$(UV_VERSION)/bin/uv
INSTALLER ?= uv
ifeq ($(INSTALLER),pip)
GET_INSTALLER := @true
PIP_INSTALL := $(VENV)/bin/pip install -q
else
GET_INSTALLER := @test -x $(UV) || $(MAKE) --no-print-directory $(UV)
PIP_INSTALL := $(UV) pip install -q --python $(VENV)/bin/python --compile-bytecode
endif
INSTALL := $(PIP_INSTALL) --require-hashes --no-deps -r
$(VENV)/.host: requirements/host.txt pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; v == (3, 11) or print(f"warning: the lock files are made for Python 3.11, $(PYTHON) is {v[0]}.{v[1]}: a package that only another Python needs may be missing (PYTHON=python3.11 picks another)", file=sys.stderr)'
	$(GET_INSTALLER)
	$(PYTHON) -m venv $(VENV)
	$(INSTALL) requirements/host.txt
	$(PIP_INSTALL) --no-deps -e .
	touch $@

$(VENV)/.dev: $(VENV)/.host requirements/dev.txt
	$(GET_INSTALLER)
	$(INSTALL) requirements/dev.txt
	touch $@

host-setup: $(VENV)/.host ## venv for running the cluster (no torch)
setup: $(VENV)/.dev ## venv for the app, local runs and the tests

# The lock files (docs/dependencies.md): uv resolves pyproject.toml's dependencies and extras for
# CPython 3.11 on Linux x86_64 (the dev venv's and the offline image's), whatever
# Python or OS runs it, and keeps every version already locked (UPGRADE=1: the
# newest that fit; LOCK_ARGS: more uv options). dev.txt first, the superset; the
# other four take its versions. host.txt is the project's own dependencies (the
# orchestrator's, with its report and compose extras);
# app.txt and tracking-server.txt an extra alone, without them (the images carry no Docker SDK):
# uv reads pyproject.toml's project with its dependencies always, so those two are
# compiled from the extra's lines, written to .cache/lock/EXTRA.in (tomllib: Python 3.11 or newer).
COMPILE := UV_CUSTOM_COMPILE_COMMAND="make lock" $(UV) pip compile -q --generate-hashes --python-version 3.11 \
           --python-platform x86_64-manylinux_2_36 --no-emit-package triton $(if $(UPGRADE),--upgrade) $(LOCK_ARGS)
EXTRA_IN = mkdir -p .cache/lock && $(PYTHON) -c 'import sys, tomllib; \
           print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]))' \
           $(1) > .cache/lock/$(1).in

$(UV):
	$(PYTHON) -m venv .cache/uv-$(UV_VERSION)
	.cache/uv-$(UV_VERSION)/bin/pip install -q uv==$(UV_VERSION)

lock: $(UV) ## write requirements/*.txt (versions + hashes) from pyproject.toml and images/torch-pair.txt; UPGRADE=1 takes the newest
	$(COMPILE) pyproject.toml --extra app --extra dev --extra report --extra compose -c images/torch-pair.txt \
		-o requirements/dev.txt
	$(COMPILE) pyproject.toml --extra report --extra compose -c requirements/dev.txt -o requirements/host.txt
	$(call EXTRA_IN,app) && $(COMPILE) .cache/lock/app.in -c requirements/dev.txt -o requirements/app.txt
	$(COMPILE) images/torch-pair.txt -c requirements/dev.txt -o requirements/torch.txt
	$(call EXTRA_IN,tracking-server) && $(COMPILE) .cache/lock/tracking-server.in -c requirements/dev.txt \
		-o requirements/tracking-server.txt

# `make clean`: what the commands write in the checkout, caches and downloads,
# and runs/ (the state of `make local`'s runs and the record of the last `up`).
# Never .venv, data/, a Docker volume (the checkpoints of container runs, which
# `make down` keeps; `python -m orchestrator down -v` removes one) or an image.
clean: ## remove runs/ (local runs' checkpoints and metrics, the last up's record), .cache/, images/.cache/, images/wheelhouse/ and images/wheelhouse-tracking/, the pytest, mypy and ruff caches and every __pycache__; no volume, no image, not .venv
	rm -rf runs .cache images/.cache images/wheelhouse images/wheelhouse-tracking .pytest_cache .mypy_cache .ruff_cache
	find . -path ./.git -prune -o -path ./.venv -prune -o -path ./data -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# make test runs the suite on TEST_WORKERS pytest-xdist workers (0: in one process): the tests
# marked docker in two chains, each one after the other on a worker, the rest beside them
# (tests/conftest.py).
TEST_WORKERS ?= 3
test: setup ## the whole test suite, containers included (TEST_WORKERS=N side by side, default 3)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25

lint: setup ## ruff (lint rules, formatting) and mypy (types) over the tree (pyproject.toml [tool.ruff], [tool.mypy]); FIX=1 applies ruff's fixes
	$(if $(FIX),$(PY) -m ruff check --fix . && $(PY) -m ruff format .,$(PY) -m ruff check . && $(PY) -m ruff format --check .)
	$(PY) -m mypy

test-fast: setup ## unit tests only (no processes, no containers)
	$(PY) -m pytest -m 'not slow'

render: host-setup ## write compose.yaml from CONFIG (and WORKERS); TARGET=swarm writes stack.yaml, TARGET=kubernetes kubernetes.yaml
	$(ORCH) render $(CFG) $(if $(TARGET),--target $(TARGET)) $(ARGS)

sample-data: setup ## write data/sample-imagenette/ (train/, val/ of JPEG/PNG) from scikit-learn's digits, for configs/cpu-resnet.yaml
	$(ORCH) sample-data

local: setup ## PS + workers as local processes (CONFIG, WORKERS; RESUME=1 continues the newest checkpoint)
	$(ORCH) local $(CFG) $(RESUMING) $(ARGS)

# The cluster in containers (orchestrator/verbs/cluster.py on the compose target). logs, status and down act
# on the cluster `up` started last, unless CONFIG, WORKERS or NAME is given (NAME alone: the last up of that name).
LAST    := $(if $(filter file,$(origin CONFIG)),,-c $(CONFIG)) $(if $(WORKERS),--workers $(WORKERS)) \
           $(if $(STRATEGY),--strategy $(STRATEGY)) $(NAMED)

engine: ## install and start Debian's Docker engine if missing (root or sudo)
	.ci/engine.sh

build: host-setup ## build CONFIG's image, and its MLflow server's with tracking.mlflow: true (Docker SDK, progress streamed)
	$(ORCH) build $(CFG) $(ARGS)

up: host-setup ## render, build if missing, start PS + WORKERS workers detached (a new run; RESUME=1 continues the newest checkpoint)
	$(ORCH) up $(CFG) $(RESUMING) $(ARGS)

logs: host-setup ## follow every service's log, prefixed by service
	$(ORCH) logs $(LAST) $(ARGS)

status: host-setup ## one line per service: state, exit code, step, loss
	$(ORCH) status $(LAST) $(ARGS)

down: host-setup ## stop and remove the cluster; checkpoints and metrics stay
	$(ORCH) down $(LAST)

runs: ## every run on this host (local, compose, swarm): id, state, steps, metric, where (ARGS="show ID", ARGS="rm NAME")
	$(ORCH) runs $(ARGS)

# TensorBoard on the runs' event files (orchestrator/verbs/tensorboard.py): the last up's project, every
# run side by side; RUN=<id> one run, PORT=N (default 6006 or the next free), LOCAL=1 make local's runs.
tensorboard: $(if $(LOCAL),setup,host-setup) ## TensorBoard of the last up's runs at http://127.0.0.1:6006/ (RUN=<id>, PORT=N, LOCAL=1); make down stops it
	$(ORCH) tensorboard $(if $(LOCAL),$(CFG) --local,$(LAST)) $(if $(RUN),--run $(RUN)) $(if $(PORT),--port $(PORT))
# The run's trained model out for plain PyTorch (orchestrator/verbs/export.py): runs/<name>/model/
# model.pt (a state_dict) and model.json; RUN=<id> an earlier run, LOCAL=1 make local's runs.
export: $(if $(LOCAL),setup,host-setup) ## the last up's trained model to runs/<name>/model/: model.pt, model.json (RUN=<id>, LOCAL=1)
	$(ORCH) export $(if $(LOCAL),$(CFG) --local,$(LAST)) $(if $(RUN),--run $(RUN))
scale: host-setup ## grow or shrink the running cluster to WORKERS workers (up to workers.max) without stopping it
	$(if $(WORKERS),,$(error make scale needs WORKERS=N))$(ORCH) scale $(if $(filter file,$(origin CONFIG)),,-c $(CONFIG)) --workers $(WORKERS) $(NAMED)

smoke: host-setup ## cpu-smoke, 2 workers, in containers: accuracy >= 0.90, all exit 0
	$(ORCH) smoke $(NAMED)

# The connectivity check (orchestrator/verbs/check.py): LOCAL=1 as processes, TIMEOUT=S.
check: $(if $(LOCAL),setup,host-setup) ## rank 0 sends a tensor to every rank and back: one line per rank; a missing rank fails by name
	$(ORCH) check $(CFG) $(if $(LOCAL),--local) $(if $(TIMEOUT),--timeout $(TIMEOUT)) $(ARGS)

chaos: setup ## kill workers, the PS, checkpoint writes (processes, containers, a swarm node); print how each recovered
	$(ORCH) chaos $(SCENARIOS) $(if $(NO_CONTAINERS),--no-containers)

soak: host-setup ## random faults in a compose run for MINUTES (default 10; FAULTS=N: at least N; SEED=N replays one; SEEDS=K: K seeds, one table), then the invariants
	$(ORCH) chaos soak $(if $(MINUTES),--minutes $(MINUTES)) $(if $(FAULTS),--faults $(FAULTS)) $(if $(SEED),--seed $(SEED)) $(if $(SEEDS),--seeds $(SEEDS)) $(NAMED)

gpu-check: host-setup ## doctor with the GPU probe, then cnn on digits for a minute, one worker per GPU: samples/s, GPU, UUID
	$(ORCH) gpu-check -c $(CONFIG)

doctor: host-setup ## check this host for CONFIG: one line per check (TARGET=swarm for a stack; NO_PROBE=1 skips the GPU probe container)
	$(ORCH) doctor $(CFG) $(if $(TARGET),--target $(TARGET)) $(if $(NO_PROBE),--no-probe) $(ARGS)

# The same topology on Docker Swarm (orchestrator/verbs/cluster.py on the swarm target, docs/multi-host.md).
# stack-logs, stack-status and stack-down act on the last stack-up unless CONFIG is given.
stack-up: host-setup ## doctor (swarm), render runs/<name>/stack.yaml, docker stack deploy (RESUME=1 as for up)
	$(ORCH) stack-up $(CFG) $(RESUMING) $(ARGS)

stack-down: host-setup ## docker stack rm, wait until its containers and network are gone
	$(ORCH) stack-down $(LAST)

stack-scale: host-setup ## not on Swarm yet: refused with one line (make scale runs on compose)
	$(ORCH) stack-scale $(if $(filter file,$(origin CONFIG)),,-c $(CONFIG)) --workers $(or $(WORKERS),1) $(NAMED)

stack-logs: host-setup ## follow every service's log of the stack
	$(ORCH) stack-logs $(LAST)

stack-status: host-setup ## one line per service: newest task's state, exit code, retries
	$(ORCH) stack-status $(LAST)

stack-tensorboard: host-setup ## refused with one line: a stack's event files are on the PS node's volume
	$(ORCH) stack-tensorboard

stack-export: host-setup ## the last stack-up's trained model to runs/<name>/model/, from the state volume on this node (RUN=<id>)
	$(ORCH) stack-export $(LAST) $(if $(RUN),--run $(RUN))

stack-smoke: host-setup ## cpu-smoke as a swarm stack on this engine: accuracy >= 0.90, all tasks exit 0
	$(ORCH) stack-smoke $(NAMED)

# Plots of runs' metrics (orchestrator/metrics/report.py) and the strategies side by side
# (orchestrator/metrics/compare.py). RUN: run directories (default: the last `up`);
# OUT: where the PNGs go. compare: STRATEGIES=async,sync EPOCHS=N (WORKERS: 2).
.PHONY: report compare
report: host-setup ## PNG plots (loss, accuracy, samples/s, staleness) and a summary; RUN="runs/a runs/b", NAME=: that run
	$(ORCH) report $(RUN) $(NAMED) $(if $(OUT),-o $(OUT))

compare: setup ## async, sync, ssp, allreduce on CPU digits as processes: one report of all four, a table
	$(ORCH) compare $(if $(STRATEGIES),--strategies $(STRATEGIES)) $(if $(WORKERS),--workers $(WORKERS)) \
		$(if $(EPOCHS),--epochs $(EPOCHS))

# Benchmarks (bench/): printed figures, not tests. BENCH_ARGS passes options,
# e.g. make bench BENCH_ARGS="--json bench.json", make bench-full BENCH_ARGS="--quick".
.PHONY: bench bench-full bench-containers bench-data bench-gpu bench-cuda
bench: setup ## s/step per strategy vs compute alone, ResNet-18 and MNIST CNN, 2 workers (3-4 min)
	$(PY) -m bench $(BENCH_ARGS)

bench-full: setup ## the full matrix: app vs official-example PS vs Gloo vs memcpy, 1-2 workers, 3 models
	$(PY) -m bench full $(BENCH_ARGS)

bench-gpu: setup ## the GPU regime on CPU: ResNet-18's 44.8 MB, compute a sleep over its layers; C 13/25 ms, processes and compose (<5 min; --full: the sweep)
	$(PY) -m bench gpu $(BENCH_ARGS)

bench-cuda: setup ## on a GPU host: ResNet-18 b128 224 px, plain PyTorch vs the app (async, overlap, sync, allreduce; 1-2 workers; fp32, bf16; GPU idle share) (~8 min, estimated)
	$(PY) -m bench cuda $(BENCH_ARGS)

bench-containers: setup ## cpu-smoke as processes vs in compose (needs Docker): throughput ratio
	$(PY) -m bench containers $(BENCH_ARGS)

# docs/topology.md is generated from the field docs of app/options.py and orchestrator/topology/
# (a test fails when it is out of date).
.PHONY: docs
docs: host-setup ## regenerate docs/topology.md and configs/topology.schema.json from the topology's field docs
	$(ORCH) schema --markdown > docs/topology.md.tmp && mv docs/topology.md.tmp docs/topology.md
	$(ORCH) schema > configs/topology.schema.json.tmp && mv configs/topology.schema.json.tmp configs/topology.schema.json

bench-data: setup ## ImageFolder images/s per worker on one core: today, first (decoding) epoch, cached epoch
	$(PY) -m bench data $(BENCH_ARGS)
