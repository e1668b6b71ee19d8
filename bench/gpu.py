"""`python -m bench gpu`: the GPU regime measured on a CPU.

ResNet-18's 11.7 M parameters (every step pushes and pulls ~45 MB) with a
compute that is a sleep of C seconds (bench/sleep_model/sleep_resnet.py): what
a step costs on top of its compute when the forward and backward leave the CPU.
Every ps-compose row is the app itself, `python -m app ps|worker`, given that
model as a user's own (`code:` the sleep_model directory, `train.model:
sleep_resnet:resnet18_<C>ms`): as processes through `python -m orchestrator
local`, in containers through compose (its own project `gpubench-<pid>-<n>`,
removed with its volume afterwards). A step's time comes from the workers'
`train` metrics records (one a batch): the steady state of bench/gpu_report.py.
`compute alone` runs the app's worker step (`Trainer.compute_gradients`) with no
PS; `official` is the published PyTorch example (bench/official.py) on the same
model.

Default (a few minutes on a 2-core CPU VM): C = 65 ms, 2 workers, every row as
processes and the containers' sync and --overlap rows. `--full`: C = 30, 65,
130 ms; 2 and 4 workers; 2 PS shards with 4; every row in containers too.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import gpu_report

ROOT = Path(__file__).resolve().parent.parent
CODE = ROOT / "bench" / "sleep_model"
BASE_IMAGE = "ps-compose-base:bookworm"
TOPOLOGY_NAME = "gpubench"  # the image is ps-compose-gpubench:latest
DEFAULT_STEPS = (10, 60)  # warm-up and timed batches per worker
CONTAINER_SYSTEMS = ("sync", "overlap")  # the default run's rows in containers
PS_SYSTEMS = {"async": ("async", False), "overlap": ("async", True), "sync": ("sync", False)}


def topology(system: str, compute_ms: int, workers: int, shards: int, batches: int) -> dict[str, Any]:
    """The topology of one case: the sleep model as the user's own code, `batches` per worker."""
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
            "log_every": 1,
        },
        "ps": {"checkpoint_every": 0, "rpc_timeout": 120, "shards": shards},
        "workers": {"count": workers},
    }


def batch_times(files: dict[str, list[str]], workers: int) -> list[list[float]]:
    """Per worker (rank order), the time of each of its `train` records (one a batch)."""
    out = []
    for rank in range(1, workers + 1):
        records = [json.loads(line) for line in files.get(f"worker{rank}.jsonl", []) if line.strip()]
        out.append([r["time"] for r in records if r.get("event") == "train"])
    return out


def run_processes(t: dict[str, Any], timeout: float) -> dict[str, list[str]]:
    """`python -m orchestrator local` in a scratch directory; its metrics files' lines."""
    import yaml

    with tempfile.TemporaryDirectory(prefix="gpubench-local-") as tmp:
        config = Path(tmp, "topology.yaml")
        config.write_text(yaml.safe_dump(t))
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        argv = [sys.executable, "-m", "orchestrator", "local", "-c", str(config)]
        proc = subprocess.Popen(
            argv, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            raise RuntimeError(f"orchestrator local did not finish within {timeout:.0f} s") from None
        if proc.returncode != 0:
            tail = " | ".join(out.decode(errors="replace").strip().splitlines()[-3:])
            raise RuntimeError(f"orchestrator local exited {proc.returncode}: {tail}")
        metrics = next(Path(tmp, "runs").glob("*/metrics"))
        return {f.name: f.read_text().splitlines() for f in metrics.glob("*.jsonl")}


def build_image(t: dict[str, Any]) -> None:
    """The case's image (FROM the offline base; the layer cache makes a rebuild quick)."""
    from orchestrator import images
    from orchestrator.topology.model import Topology

    model = Topology.model_validate(t)
    base, pip_source = images.source(model, offline=True)
    images.build(model.image_tag, base, pip_source, out=io.StringIO())


def run_containers(t: dict[str, Any], timeout: float, project: str) -> dict[str, list[str]]:
    """The case rendered for compose and run under `project`; its metrics files' lines.
    The project and its volume are removed afterwards, whatever happened."""
    from orchestrator import images
    from orchestrator.backends import command
    from orchestrator.backends.compose import adapter
    from orchestrator.render import compose
    from orchestrator.render.yamlio import write_atomic
    from orchestrator.topology.model import Topology
    from orchestrator.topology.services import service_names

    model = Topology.model_validate(t)
    client = images.client()
    found = adapter.detect()
    with tempfile.TemporaryDirectory(prefix="gpubench-compose-") as tmp:
        proj = adapter.Project(project, str(Path(tmp) / "compose.yaml"), str(ROOT))
        try:
            write_atomic(proj.file, compose.dump(compose.render(model), model.name))
            command.run(adapter.up_argv(found, proj), capture=True)
            finished = adapter.wait_exited(client, project, len(service_names(model)), timeout, io.StringIO())
            if finished is None:
                raise RuntimeError(f"the compose run did not end within {timeout:.0f} s")
            return adapter.read_metrics(client, project, adapter.containers(client, project))
        finally:
            command.run(adapter.down_argv(found, proj, volumes=True), capture=True, check=False)


def run_official(compute_ms: int, workers: int, batches: int, warmup: int, timeout: float) -> list[list[float]]:
    """The published example on the sleep model (bench/official.py): each trainer's step ends."""
    with tempfile.TemporaryDirectory(prefix="gpubench-official-") as tmp:
        out = Path(tmp, "steps.json")
        argv = [sys.executable, "-m", "bench.official", "--model", f"sleep:{compute_ms}"]
        argv += ["--trainers", str(workers), "--warmup", str(warmup), "--steps", str(batches - warmup)]
        argv += ["--out", str(out)]
        proc = subprocess.run(
            argv, cwd=ROOT, capture_output=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT))
        )
        if proc.returncode != 0 or not out.exists():
            tail = " | ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-3:])
            raise RuntimeError(f"bench.official exited {proc.returncode}: {tail}")
        return json.loads(out.read_text())["step_ends"]


def run_compute_alone(compute_ms: int, batches: int) -> list[list[float]]:
    """The app's worker step (`Trainer.compute_gradients`) on the sleep model, no PS: the
    time each of `batches` steps ended, as one worker's."""
    import torch

    sys.path.insert(0, str(CODE))
    import sleep_resnet

    from app.config import parse
    from app.worker.trainer import Trainer

    config = parse(["worker", "--model", f"sleep_resnet:resnet18_{compute_ms}ms", "--batch_size", "20"], {})
    model = getattr(sleep_resnet, f"resnet18_{compute_ms}ms")(10, 3)
    data, _, _ = sleep_resnet.images("", True, 0)
    x = torch.stack([data[i][0] for i in range(20)])
    y = torch.tensor([data[i][1] for i in range(20)])
    trainer = Trainer(config, model, None, None, torch.device("cpu"), None, None)  # type: ignore[arg-type]
    ends = []
    for _ in range(batches):
        trainer.compute_gradients(x, y)
        ends.append(time.time())
    return [ends]


def cases(args: argparse.Namespace) -> list[tuple[int, int, int, str, str]]:
    """(C ms, workers, shards, where, system) of the run, in the order they run."""
    out = []
    for c in args.compute_ms:
        out.append((c, 1, 1, "processes", "compute"))
        for n in args.workers:
            layouts = [1] + ([2] if n >= 4 else [])  # 4 workers: also 2 PS shards
            for shards in layouts:
                systems = args.systems if shards == 1 else ["async", "overlap", "sync"]
                for s in systems:
                    out.append((c, n, shards, "processes", s))
                for s in args.containers:
                    if s in systems and s != "official":
                        out.append((c, n, shards, "containers", s))
    return out


def run_case(case: tuple[int, int, int, str, str], args: argparse.Namespace, project: str) -> dict[str, Any]:
    c, n, shards, where, system = case
    warmup, steps = args.warmup, args.steps
    batches = warmup + steps
    if system == "compute":
        times = run_compute_alone(c, batches)
    elif system == "official":
        times = run_official(c, n, batches, warmup, args.timeout)
    else:
        t = topology(system, c, n, shards, batches)
        if where == "containers":
            files = run_containers(t, args.timeout, project)
        else:
            files = run_processes(t, args.timeout)
        times = batch_times(files, n)
    steady = gpu_report.steady_step(times, warmup)
    return dict(compute_ms=c, workers=n, shards=shards, where=where, system=system, **steady)


def main(args: argparse.Namespace) -> int:
    from bench.__main__ import machine

    started = time.monotonic()
    where = machine()
    todo = cases(args)
    if any(w == "containers" for _, _, _, w, _ in todo):
        print("bench gpu: building the image ...", file=sys.stderr, flush=True)
        build_image(topology("sync", todo[0][0], 2, 1, 2))
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    for repeat in range(1, args.repeats + 1):
        for i, case in enumerate(todo):
            c, n, shards, place, system = case
            label = f"[{repeat}/{args.repeats}] C={c}ms x{n}" + (f" {shards} shards" if shards > 1 else "")
            label += f" {place} {system}"
            print(f"bench gpu: {label} ...", file=sys.stderr, flush=True)
            try:
                runs.append(dict(run_case(case, args, f"gpubench-{os.getpid()}-{i}"), repeat=repeat))
            except Exception as error:  # noqa: BLE001 - one failed case is reported, the others stand
                failures.append(f"{label}: {type(error).__name__}: {error}")
                print(f"bench gpu: {label}: FAILED: {error}", file=sys.stderr, flush=True)
    rows = gpu_report.aggregate(runs)
    wall = time.monotonic() - started
    where["loadavg_end"] = os.getloadavg()
    print(gpu_report.table(rows))
    print(
        f"\nsteady state: {args.steps} timed batches per worker after {args.warmup} of warm-up, medians over "
        f"{args.repeats} repeat(s); {wall:.0f} s on {where['cores']} cores; load average "
        f"{where['loadavg_start'][0]:.1f} at the start, {where['loadavg_end'][0]:.1f} at the end"
    )
    if failures:
        print("failed cases:\n  " + "\n  ".join(failures))
    if args.json:
        doc = gpu_report.document(rows, runs, _settings(args), where, failures, wall)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.json}")
    return 1 if failures else 0


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


def add_parser(sub: Any) -> None:
    g = sub.add_parser("gpu", help="the GPU regime: ResNet-18's bytes, a sleep for compute (containers need Docker)")
    g.add_argument("--full", action="store_true", help="C 30,65,130 ms; 2 and 4 workers, 2 shards; all in containers")
    g.add_argument("--compute-ms", type=_int_list, help="C values in ms, comma-separated (default 65)")
    g.add_argument("--workers", type=_int_list, help="worker counts, comma-separated (default 2)")
    ps_rows = tuple(s for s in gpu_report.SYSTEMS if s != "compute")
    g.add_argument("--systems", type=_systems(ps_rows), help=f"rows as processes (default all: {','.join(ps_rows)})")
    g.add_argument(
        "--containers",
        type=_systems(tuple(PS_SYSTEMS) + ("allreduce",)),
        help=f"rows also in compose containers (default {','.join(CONTAINER_SYSTEMS)}; empty: none)",
    )
    g.add_argument("--warmup", type=int, default=DEFAULT_STEPS[0], help="untimed batches per worker")
    g.add_argument("--steps", type=int, default=DEFAULT_STEPS[1], help="timed batches per worker")
    g.add_argument("--repeats", type=int, default=1)
    g.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    g.add_argument("--json", metavar="FILE", help="write rows, settings and raw runs here")


def resolve(args: argparse.Namespace) -> None:
    """Fill what --full and the defaults leave unset."""
    ps_rows = [s for s in gpu_report.SYSTEMS if s != "compute"]
    if args.compute_ms is None:
        args.compute_ms = [30, 65, 130] if args.full else [65]
    if args.workers is None:
        args.workers = [2, 4] if args.full else [2]
    if args.systems is None:
        args.systems = ps_rows
    if args.containers is None:
        args.containers = ["async", "overlap", "sync", "allreduce"] if args.full else list(CONTAINER_SYSTEMS)
