"""`python -m orchestrator gpu-check`: does this host give every GPU to its own worker, and train?

1. The compose doctor (backends/compose/doctor.py) on CONFIG: any problem stops here with its
   one line (`PROBLEM ...`) and exit status 1; nothing is built or started.
2. CONFIG's image is built if missing; the doctor's probe container runs in it with
   the GPUs the run will use.
3. A one-minute run of cpu-smoke's model (cnn on digits) in containers, one worker
   per host GPU (device cuda), in the project `gpu-check` with CONFIG's image.
4. One line per worker: samples/s, its GPU's name and UUID (from its metrics' `join`
   record), and whether every worker saw a different GPU. The project is removed.

The choice of the run's topology and the summary of its metrics are pure functions
(`check_topology`, `summarize`, `verdict`), unit-tested without a GPU.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from statistics import median
from typing import Any, Optional, TextIO

import yaml

from app.contract import Event
from orchestrator.backends.compose import doctor
from orchestrator.doctor.checks import host_gpus, run_checks
from orchestrator.doctor.facts import Facts, gather
from orchestrator.doctor.probe import check_probe
from orchestrator.errors import UsageError
from orchestrator.metrics.records import is_event, parse_lines
from orchestrator.paths import DEFAULT_CONFIG, HOME, ROOT, RUNS, SMOKE_CONFIG
from orchestrator.topology.model import Topology, load, parse
from orchestrator.topology.services import describe, worker_name

PROJECT = "gpu-check"
RUN_SECONDS = 60.0
JOIN_TIMEOUT = 900.0  # the first start of a CUDA image can take minutes
WARMUP_SECONDS = 10.0  # left out of samples/s: cuDNN autotuning, first allocations


def check_topology(t: Topology, gpus: list[int], smoke: Topology) -> Topology:
    """cpu-smoke's training (`smoke`) on CONFIG's image (`t`: base, tag, group_add), device
    cuda, one worker per GPU id in `gpus`, the PS on CPU, long enough to be stopped."""
    doc: dict[str, Any] = yaml.safe_load(yaml.safe_dump(smoke.model_dump(mode="json", exclude_none=True)))
    doc["name"] = PROJECT
    doc["image"] = {"base": t.image.base, "device": "cuda", "pip_source": t.image.pip_source, "tag": t.image_tag}
    if t.image.group_add:
        doc["image"]["group_add"] = list(t.image.group_add)
    doc["train"].update(epochs=10_000, max_steps=0)
    doc["ps"].pop("gpu", None)
    doc["ps"]["shards"] = 1
    doc["workers"].update(count=len(gpus), gpus=list(gpus))
    doc.pop("swarm", None)
    return parse(yaml.safe_dump(doc, sort_keys=False), f"gpu-check ({SMOKE_CONFIG} on {t.image_tag})")


@dataclass(frozen=True)
class WorkerRow:
    worker: str
    samples_per_s: Optional[float]  # median of the train records after the warm-up
    gpu: str
    gpu_uuid: str


def summarize(files: dict[str, list[str]], workers: list[str], since: float) -> list[WorkerRow]:
    """One row per worker (in `workers` order) from its metrics file's lines: the GPU its
    `join` record names, and the median samples/s of its `train` records written after `since`."""
    rows = []
    for w in workers:
        records = parse_lines(files.get(f"{w}.jsonl", []))
        join = next((r for r in reversed(records) if is_event(r, Event.JOIN)), {})
        rates = [
            r["samples_per_s"]
            for r in records
            if is_event(r, Event.TRAIN) and r.get("time", 0) >= since and r.get("samples_per_s") is not None
        ]
        rows.append(WorkerRow(w, median(rates) if rates else None, join.get("gpu", "?"), join.get("gpu_uuid", "?")))
    return rows


def verdict(rows: list[WorkerRow]) -> list[str]:
    """The problems (empty: passed): a worker that did not train, or named no GPU, or two
    workers on one GPU."""
    problems = [f"{r.worker}: no train record after the warm-up" for r in rows if r.samples_per_s is None]
    problems += [f"{r.worker}: its join record names no GPU" for r in rows if r.gpu_uuid == "?"]
    seen: dict[str, str] = {}
    for r in rows:
        if r.gpu_uuid != "?" and r.gpu_uuid in seen:
            problems.append(f"{r.worker} and {seen[r.gpu_uuid]} saw the same GPU {r.gpu_uuid}")
        seen.setdefault(r.gpu_uuid, r.worker)
    return problems


def format_rows(rows: list[WorkerRow]) -> list[str]:
    lines = [f"{'WORKER':<9} {'SAMPLES/S':>10}  {'GPU':<28} UUID"]
    for r in rows:
        rate = "-" if r.samples_per_s is None else f"{r.samples_per_s:.0f}"
        lines.append(f"{r.worker:<9} {rate:>10}  {r.gpu:<28} {r.gpu_uuid}")
    return lines


# --- the command (thin: asks Docker) ------------------------------------------


def preflight(t: Topology, config: str, facts: Facts, out: TextIO) -> bool:
    """The doctor's checks of the run's topology `t`; on a problem, its lines and False
    (the caller exits 1)."""
    checks = run_checks(doctor.CHECKS, t, facts)
    bad = [c for c in checks if c.ok is False]
    if bad:
        for c in bad:
            print(c.line(), file=out)
        print(
            f"gpu-check: stopped: {len(bad)} problem(s) on this host for {config}; nothing was started",
            file=out,
            flush=True,
        )
        return False
    return True


def run(config: str = DEFAULT_CONFIG, *, seconds: float = RUN_SECONDS, out: TextIO = sys.stdout) -> int:
    from orchestrator import images

    t = load(config)
    if not t.cuda:
        raise UsageError(f"{config}: image.device: got 'cpu'; gpu-check needs a cuda topology (configs/default.yaml)")
    client = images.client()
    smoke = load(HOME / SMOKE_CONFIG)
    # First without the probe: the host's GPUs (one worker each), or CONFIG's ids when it cannot list them.
    facts = gather(check_topology(t, t.worker_gpus(), smoke), client=client, target=doctor.gather_facts)
    gpus, _ = host_gpus(facts)
    run_t = check_topology(t, gpus or t.worker_gpus(), smoke)
    if not preflight(run_t, config, facts, out):
        return 1
    if not images.image_exists(client, t.image_tag):
        base, pip_source = images.source(t, offline=False)
        images.build(t.image_tag, base, pip_source, out=out)
    facts = gather(run_t, client=client, probe=True, target=doctor.gather_facts)
    if not preflight(run_t, config, facts, out):
        return 1
    print(f"==> doctor: passed; probe: {check_probe(run_t, facts).text}", file=out, flush=True)
    return _train(client, run_t, seconds, out)


def _train(client: Any, t: Topology, seconds: float, out: TextIO) -> int:
    from orchestrator.backends import command
    from orchestrator.backends.compose import adapter
    from orchestrator.render import compose
    from orchestrator.render.yamlio import write_if_changed

    found = adapter.detect()
    path = RUNS / PROJECT / "compose.yaml"
    write_if_changed(path, compose.dump(compose.render(t), t.name))
    project = adapter.Project(PROJECT, str(path), str(ROOT))
    workers = [worker_name(r) for r in range(1, t.workers.count + 1)]
    command.run(adapter.down_argv(found, project, volumes=True), capture=True, check=False)
    try:
        print(f"==> gpu-check: {describe(t)} on GPUs {t.worker_gpus()}, {seconds:.0f} s", file=out, flush=True)
        command.run(adapter.up_argv(found, project))
        joined = _wait_joined(client, workers)
        if joined is None:
            adapter.print_logs(client, PROJECT, out)
            print(f"gpu-check: FAILED: not every worker joined within {JOIN_TIMEOUT:.0f} s", file=out)
            return 1
        time.sleep(seconds)
        files = adapter.read_metrics(client, PROJECT, adapter.containers(client, PROJECT))
        rows = summarize(files, workers, joined + WARMUP_SECONDS)
    finally:
        command.run(adapter.down_argv(found, project, volumes=True), capture=True, check=False)
    for line in format_rows(rows):
        print(line, file=out)
    problems = verdict(rows)
    for p in problems:
        print(f"gpu-check: FAILED: {p}", file=out)
    if not problems:
        print(f"gpu-check: passed: {len(rows)} worker(s), each on a different GPU", file=out)
    return 1 if problems else 0


def _wait_joined(client: Any, workers: list[str]) -> Optional[float]:
    """The time (unix) the last worker wrote its `join` record; None at the timeout."""
    from orchestrator.backends.compose import adapter

    deadline = time.monotonic() + JOIN_TIMEOUT
    while time.monotonic() < deadline:
        files = adapter.read_metrics(client, PROJECT, adapter.containers(client, PROJECT))
        joins = [
            next((r["time"] for r in parse_lines(files.get(f"{w}.jsonl", [])) if is_event(r, Event.JOIN)), None)
            for w in workers
        ]
        found = [j for j in joins if j is not None]
        if len(found) == len(joins):
            return max(found)
        time.sleep(5)
    return None
