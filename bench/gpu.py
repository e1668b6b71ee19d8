"""`python -m bench gpu`: the GPU regime measured on a CPU.

ResNet-18's 11.2 M parameters (every step pushes and pulls 44.8 MB) with a
compute that is a sleep of C seconds spread over its layers, forward and
backward (bench/sleep_model/sleep_resnet.py): what a step costs on top of its
compute when the forward and backward leave the CPU. Every ps-compose row is
the app itself, `python -m app ps|worker`, given that model as a user's own
(`code:` the sleep_model directory, `train.model: sleep_resnet:resnet18_<C>ms`):
as processes through `python -m orchestrator local`, in containers through
compose (bench/launch.py). A step's time comes from the workers' `train`
metrics records (one a batch): the steady state of bench/gpu_report.py.
`compute alone` runs the app's worker step (`Trainer.compute_gradients`) with
no PS; `official` is the published PyTorch example (bench/official.py) on the
same model. Under each C's async rows, their floor: compute alone plus the PS's
update of one push measured alone (bench/ps_update.py), as a worker's next
forward waits for it.

Default (under 5 minutes on a 2-core CPU VM): C = 13 and 25 ms (ResNet-18,
batch 128 at 224 px, on an H200 in bf16 + channels_last and in fp32), 1 and 2
workers, async, --overlap and sync as processes, --overlap and sync in
containers with 2 workers. `--full`: C = 13, 25, 65 ms; 1, 2 and 4 workers; 2 PS
shards with 4; allreduce and the published example too; every PS row and
allreduce in containers at every worker count.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

from app.option_table import OPTIONS
from bench import gpu_report, harness, host_cpu, launch, ps_update

APP_LOG_EVERY = next(o.default for o in OPTIONS if o.name == "log_every")  # the app's: every 10 batches
CODE = launch.ROOT / "bench" / "sleep_model"
BASE_IMAGE = "ps-compose-base:bookworm"
TOPOLOGY_NAME = "gpubench"  # the image is ps-compose-gpubench:latest
PS_SYSTEMS = {"async": ("async", False), "overlap": ("async", True), "sync": ("sync", False)}
# What the default run and --full run when no flag says otherwise.
DEFAULTS = {
    "compute_ms": [13, 25],
    "workers": [1, 2],
    "systems": ["async", "overlap", "sync"],
    "containers": ["overlap", "sync"],
    "container_workers": [2],
    "warmup": 5,
    "steps": 40,
}
FULL = {
    "compute_ms": [13, 25, 65],
    "workers": [1, 2, 4],
    "systems": ["async", "overlap", "sync", "allreduce", "official"],
    "containers": ["async", "overlap", "sync", "allreduce"],
    "container_workers": [1, 2, 4],
    "warmup": 10,
    "steps": 60,
}


def topology(
    system: str, compute_ms: int, workers: int, shards: int, batches: int, every: int | None = None
) -> dict[str, Any]:
    """The topology of one case: the sleep model as the user's own code, `batches` per worker,
    the app's defaults elsewhere; a worker reports (a log line, a `train` record) every
    `every` batches (by default `log_every(batches)`)."""
    strategy, overlap = PS_SYSTEMS.get(system, ("allreduce", False))
    return {
        "name": TOPOLOGY_NAME,
        "code": str(CODE),
        "image": {"base": BASE_IMAGE, "device": "cpu", "pip_source": "wheelhouse"},
        "train": {
            "model": f"sleep_resnet:resnet18_{compute_ms}ms",
            "dataset": "sleep_resnet:images",
            "batch_size": 20,
            "lr": 0.01,
            "epochs": 1,
            "max_steps": batches,
            "strategy": strategy,
            "overlap": overlap,
            "seed": 0,
            "eval_every": 1_000_000,
            "log_every": every or log_every(batches),
        },
        "ps": {"checkpoint_every": 0, "rpc_timeout": 120, "shards": shards},
        "workers": {"count": workers},
    }


def log_every(batches: int) -> int:
    """How often a case's workers report: never more rarely than the app does by default
    (every 10 batches), and often enough that a run of `batches` has eight reports to time
    its steps by (the default run, 45 batches: every 5)."""
    return max(1, min(APP_LOG_EVERY, batches // 8))


def batch_times(files: dict[str, list[str]], workers: int) -> tuple[list[list[float]], list[list[int]]]:
    """Per worker (rank order), the time of each of its `train` records (one every
    `train.log_every` batches), and the batch each one ended (the case runs one epoch)."""
    times, numbers = [], []
    for rank in range(1, workers + 1):
        records = [json.loads(line) for line in files.get(f"worker{rank}.jsonl", []) if line.strip()]
        train = [r for r in records if r.get("event") == "train"]
        times.append([r["time"] for r in train])
        numbers.append([r["batch"] for r in train])
    return times, numbers


def _validated(t: dict[str, Any]) -> Any:
    from orchestrator.topology.model import Topology

    return Topology.model_validate(t)


def run_official(compute_ms: int, workers: int, batches: int, warmup: int, timeout: float) -> list[list[float]]:
    """The published example on the sleep model (bench/official.py): each trainer's step ends."""
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="gpubench-official-") as tmp:
        out = Path(tmp, "steps.json")
        argv = [sys.executable, "-m", "bench.official", "--model", f"sleep:{compute_ms}"]
        argv += ["--trainers", str(workers), "--warmup", str(warmup), "--steps", str(batches - warmup)]
        argv += ["--out", str(out)]
        env = dict(os.environ, PYTHONPATH=harness.python_path(launch.ROOT))
        proc = subprocess.run(argv, cwd=launch.ROOT, capture_output=True, timeout=timeout, env=env)
        if proc.returncode != 0 or not out.exists():
            tail = " | ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-3:])
            raise RuntimeError(f"bench.official exited {proc.returncode}: {tail}")
        return json.loads(out.read_text())["step_ends"]


def run_compute_alone(compute_ms: int, batches: int) -> list[list[float]]:
    """The app's worker step (`Trainer.compute_gradients`) on the sleep model, no PS: the
    time each of `batches` steps ended, as one worker's, with the threads a worker of a
    one-worker job takes (`python -m app` sets them; the bench's own count is put back after)."""
    import torch

    from app.config import parse
    from app.runtime import machine

    if str(CODE) not in sys.path:
        sys.path.insert(0, str(CODE))
    argv = ["worker", "--world_size", "2", "--model", f"sleep_resnet:resnet18_{compute_ms}ms", "--batch_size", "20"]
    config = parse(argv, {})
    threads = torch.get_num_threads()
    machine.set_threads(machine.sharing_cpus(config))
    try:
        return [_compute_steps(config, compute_ms, batches)]
    finally:
        torch.set_num_threads(threads)


class ComputeAlone:
    """The channel and route of a worker with no PS: its backward is all there is (compute alone)."""

    def backward(self) -> Any:
        import contextlib

        return contextlib.nullcontext()


def _compute_steps(config: Any, compute_ms: int, batches: int) -> list[float]:
    import sleep_resnet
    import torch

    from app.worker.trainer import Trainer

    model = getattr(sleep_resnet, f"resnet18_{compute_ms}ms")(10, 3)
    data, _, _ = sleep_resnet.images("", True, 0)
    x = torch.stack([data[i][0] for i in range(20)])
    y = torch.tensor([data[i][1] for i in range(20)])
    alone = ComputeAlone()
    trainer = Trainer(config, model, None, None, torch.device("cpu"), alone, None)  # type: ignore[arg-type]
    trainer.route = alone  # type: ignore[assignment]  # what joining would have set: no PS here
    ends = []
    for _ in range(batches):
        trainer.compute_gradients(x, y)
        ends.append(time.time())
    return ends


def cases(args: argparse.Namespace) -> list[tuple[int, int, int, str, str]]:
    """(C ms, workers, shards, where, system) of the run, in the order they run."""
    out = []
    for c in args.compute_ms:
        out.append((c, 1, 1, "processes", "compute"))
        for n in args.workers:
            for shards in [1] + ([2] if n >= 4 else []):  # 4 workers: also 2 PS shards
                systems = args.systems if shards == 1 else [s for s in args.systems if s in PS_SYSTEMS]
                out += [(c, n, shards, "processes", s) for s in systems]
                if n in args.container_workers:
                    out += [(c, n, shards, "containers", s) for s in args.containers if s in systems]
    return out


def batches_for(system: str, workers: int, warmup: int, steps: int) -> int:
    """The batches each worker of a case runs: its warm-up and `steps` timed ones; and where
    several async workers do not wait for one another, `steps` more, so that one that started
    up to `steps` batches after the other (a process start apart: ~1 s on a 2-core CPU VM)
    still shares a steady window with it, at least `steps` long."""
    apart = workers > 1 and system in ("async", "overlap")
    return warmup + steps * (2 if apart else 1)


def step_times(
    case: tuple[int, int, int, str, str], args: argparse.Namespace, project: str
) -> tuple[list[list[float]], list[list[int]] | None]:
    """Per worker, the times its batches ended, for one case, and which batches those are
    (None: every batch, in order)."""
    c, n, shards, where, system = case
    batches = batches_for(system, n, args.warmup, args.steps)
    if system == "compute":
        return run_compute_alone(c, batches), None
    if system == "official":
        return run_official(c, n, batches, args.warmup, args.timeout), None
    t = topology(system, c, n, shards, batches, every=log_every(args.warmup + args.steps))
    if where == "containers":
        return batch_times(launch.metrics("compose", _validated(t), args.timeout, project), n)
    return batch_times(launch.metrics("local", t, args.timeout), n)


def run_case(case: tuple[int, int, int, str, str], args: argparse.Namespace, project: str) -> dict[str, Any]:
    """One case's steady step, how busy the host's cores were in its steady window, the CPU
    its workers and PS processes used there per step (gpu_report.cpu_per_step), and the cores
    the bench may use."""
    c, n, shards, where, system = case
    with host_cpu.Sampler() as cpu:
        times, numbers = step_times(case, args, project)
    steady = gpu_report.steady_step(times, args.warmup, numbers)
    busy = host_cpu.busy_share(cpu.samples, *steady["window"])
    per_step = gpu_report.cpu_per_step(host_cpu.cpu_seconds(cpu.samples, *steady["window"]), steady)
    cores = len(os.sched_getaffinity(0))
    case_fields = dict(compute_ms=c, workers=n, shards=shards, where=where, system=system, cores=cores)
    return dict(case_fields, cpu_busy=busy, **per_step, **steady)


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    where = harness.machine()
    todo = cases(args)
    if any(w == "containers" for _, _, _, w, _ in todo):
        print("bench gpu: building the image ...", file=sys.stderr, flush=True)
        launch.build_image(_validated(topology("sync", todo[0][0], 2, 1, 2)))
    # measured first, on a quiet host: the floor under each C's async rows
    update = ps_update.measure(str(CODE)) if any(s == "async" for *_, s in todo) else None
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    for repeat in range(1, args.repeats + 1):
        for i, case in enumerate(todo):
            c, n, shards, place, system = case
            label = f"[{repeat}/{args.repeats}] C={c}ms x{n}" + (f" {shards} shards" if shards > 1 else "")
            run = functools.partial(run_case, case, args, f"gpubench-{os.getpid()}-{i}")
            got = harness.attempt("bench gpu", f"{label} {place} {system}", run, failures)
            if got is not None:
                runs.append(dict(got, repeat=repeat))
    rows = gpu_report.aggregate(runs)
    wall = time.monotonic() - started
    where["loadavg_end"] = os.getloadavg()
    what = f"steady state: {args.steps} timed batches per worker after {args.warmup} of warm-up, medians"
    text = gpu_report.table(rows, update) + "\n" + harness.run_line(what, args.repeats, wall, where)
    return harness.close(
        text,
        failures,
        args.json,
        lambda: dict(gpu_report.document(rows, runs, _settings(args), where, failures, wall), ps_update=update),
    )


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("command",)}


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be comma-separated whole numbers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def _systems(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [s for s in text.split(",") if s]
        bad = [s for s in names if s not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(allowed)}")
        return names

    return parse


def _listed(values: list[Any]) -> str:
    return ",".join(str(v) for v in values)


def add_parser(sub: Any) -> None:
    g = sub.add_parser("gpu", help="the GPU regime: ResNet-18's bytes, a sleep for compute (containers need Docker)")
    d, f = DEFAULTS, FULL
    g.add_argument(
        "--full",
        action="store_true",
        help=f"C {_listed(f['compute_ms'])} ms; {_listed(f['workers'])} workers, 2 shards with 4; every row, "
        f"in containers too; {f['warmup']} + {f['steps']} batches",
    )
    g.add_argument("--compute-ms", type=_int_list, help=f"C values in ms (default {_listed(d['compute_ms'])})")
    g.add_argument("--workers", type=_int_list, help=f"worker counts (default {_listed(d['workers'])})")
    ps_rows = tuple(s for s in gpu_report.SYSTEMS if s != "compute")
    g.add_argument(
        "--systems",
        type=_systems(ps_rows),
        help=f"rows as processes, of {','.join(ps_rows)} (default {_listed(d['systems'])})",
    )
    g.add_argument(
        "--containers",
        type=_systems(tuple(PS_SYSTEMS) + ("allreduce",)),
        help=f"rows also in compose containers, of those run as processes (default {_listed(d['containers'])}; "
        "empty: none)",
    )
    g.add_argument(
        "--container-workers",
        type=_int_list,
        help=f"the worker counts the containers' rows run with (default {_listed(d['container_workers'])})",
    )
    g.add_argument("--warmup", type=int, help=f"untimed batches per worker (default {d['warmup']})")
    g.add_argument("--steps", type=int, help=f"timed batches per worker (default {d['steps']})")
    g.add_argument("--repeats", type=int, default=1)
    g.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    g.add_argument("--json", metavar="FILE", help="write rows, settings and raw runs here")


def resolve(args: argparse.Namespace) -> None:
    """Fill what the flags leave unset from DEFAULTS, or FULL with --full."""
    for name, value in (FULL if args.full else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
