"""`python -m bench cuda`: ResNet-18 trained on a real CUDA GPU, the app against compute alone.

What a user of one GPU host pays for the parameter server: ResNet-18 at batch 128 on 224 px
crops of an ImageFolder of 256-px JPEGs (written here, 10 classes; `--image_cache memory`, so
the crop, flip and normalisation run on the GPU), in fp32 and in bf16 autocast + channels_last.

- compute alone: plain PyTorch on the GPU, one batch kept there: forward, backward, SGD step,
  synchronised each step;
- the app as processes, `python -m app ps|worker` with its own flags (the PS on the CPU, each
  worker on `cuda`, every worker on the one GPU): async, `--overlap` and sync with 1 and 2
  workers, through shared memory (`--exchange auto`), and 1 worker async over the job's
  sockets (`--exchange transport`) beside it, every process on the case's secret and UNIX
  sockets, as `make local` runs them; and 1 worker async and `--overlap` with `--cuda_graphs`
  (the step's forward and backward replayed as a CUDA graph), against the same cases without;
- the app's own allreduce (`--strategy allreduce`: DDP, no PS) with 1 and 2 workers on the one
  GPU. NCCL refuses two ranks of one job on one GPU ("Duplicate GPU detected"): each rank is
  given an NCCL_HOSTID of its own, so NCCL takes them for two hosts and joins them over its
  socket transport.

A step's time comes from the workers' `train` records (bench/gpu_report.py's steady state),
which a worker writes every `--log_every` batches as a real run does (the app's default, or
more often where the run is short: bench/gpu.py's `log_every`); `samples/s` is every worker's
together, and `x GPU` that over compute alone's. `GPU idle`: after the timed batches each
worker runs `--profile-steps` more under torch.profiler (bench/cuda_trace.py), and the column is
the share of that span in which the GPU ran none of their kernels, copies or fills.
Needs only torch, torchvision, Pillow, numpy and pyzmq (no orchestrator, no Docker): it runs
on a bare GPU host. `--device cpu` runs the same plumbing on a CPU, small, to try the script where there
is no GPU (no GPU idle share there). Each case is written to `--out` as it ends, so a run cut
short keeps what it measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import cuda_trace, gpu_report, harness
from bench.gpu import log_every
from bench.procs import app_flags, free_port, job_files, job_paths

ROOT = Path(__file__).resolve().parent.parent
PRECISIONS = {"fp32": ("fp32", False), "bf16+cl": ("bf16", True)}
# system -> (strategy, overlap, cuda_graphs)
SYSTEMS = {
    "async": ("async", False, False),
    "overlap": ("async", True, False),
    "sync": ("sync", False, False),
    "allreduce": ("allreduce", False, False),
    "async+graphs": ("async", False, True),
    "overlap+graphs": ("async", True, True),
}
# (precision, system, workers, exchange), most wanted first: a run cut short keeps these.
CASES = [
    ("fp32", "overlap", 1, "auto"),
    ("fp32", "async", 1, "auto"),
    ("bf16+cl", "overlap", 1, "auto"),
    ("bf16+cl", "async", 1, "auto"),
    ("fp32", "overlap", 2, "auto"),
    ("bf16+cl", "overlap", 2, "auto"),
    ("fp32", "overlap+graphs", 1, "auto"),
    ("fp32", "async+graphs", 1, "auto"),
    ("bf16+cl", "overlap+graphs", 1, "auto"),
    ("fp32", "allreduce", 1, "-"),
    ("fp32", "allreduce", 2, "-"),
    ("fp32", "sync", 2, "auto"),
    ("fp32", "async", 2, "auto"),
    ("bf16+cl", "sync", 2, "auto"),
    ("bf16+cl", "async", 2, "auto"),
    ("fp32", "async", 1, "transport"),
    ("fp32", "sync", 1, "auto"),
    ("bf16+cl", "sync", 1, "auto"),
    ("bf16+cl", "allreduce", 1, "-"),
    ("bf16+cl", "allreduce", 2, "-"),
]


def label(case: tuple[str, str, int, str]) -> str:
    """A case as `--only` names it: precision-system-workers-exchange, e.g. fp32-overlap-1-auto."""
    return "-".join(map(str, case))


def write_images(root: Path, classes: int, per_class: int, size: int, seed: int = 0) -> None:
    """An ImageFolder of `classes` x `per_class` JPEGs of `size` px: smooth random colour fields."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"class{c:02d}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            image = Image.fromarray(small).resize((size, size), Image.BILINEAR)
            image.save(root / f"class{c:02d}" / f"{i:04d}.jpg", quality=90)


def compute_alone(precision: str, args: argparse.Namespace) -> list[list[float]]:
    """Plain PyTorch: the times `warmup + steps` steps ended (forward, backward, SGD)."""
    import torch
    import torchvision

    dtype, channels_last = PRECISIONS[precision]
    device = torch.device(args.device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = torchvision.models.resnet18(num_classes=args.classes).to(device, memory_format=fmt)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device).to(memory_format=fmt)
    y = torch.randint(0, args.classes, (args.batch,), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ends = []
    for _ in range(args.warmup + args.steps):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sync()
        ends.append(time.time())
    return [ends]


def timed(args: argparse.Namespace) -> int:
    """The batches a worker times: the warm-up and the timed ones (the profiled ones follow)."""
    return args.warmup + args.steps


def app_argv(
    role: str, rank: int, case: tuple[str, str, int, str], args: argparse.Namespace, port: int, tmp: Path
) -> list[str]:
    """`python -m app ROLE ...` for one process of `case` (the PS on the CPU, workers on the GPU);
    a worker under bench.cuda_trace, which profiles its batches after the timed ones."""
    precision, system, workers, exchange = case
    dtype, channels_last = PRECISIONS[precision]
    strategy, overlap, graphs = SYSTEMS[system]
    batches = timed(args) + args.profile_steps
    argv = [role, "--rank", str(rank), "--world_size", str(workers + 1)]
    argv += ["--master_addr", "127.0.0.1", "--master_port", str(port), "--run_id", "cuda-bench"]
    argv += ["--device", args.device if role == "worker" else "cpu", "--host_workers", str(workers)]
    argv += ["--model", "resnet18", "--dataset", "imagefolder", "--data_dir", str(tmp / "images")]
    argv += ["--image_cache", "memory", "--image_size", str(args.image_size), "--batch_size", str(args.batch)]
    argv += ["--lr", "0.01", "--seed", "0", "--num_epochs", "100000", "--max_steps", str(batches)]
    argv += ["--eval_every", "100000000", "--log_every", str(log_every(timed(args))), "--checkpoint_every", "0"]
    argv += ["--strategy", strategy, "--precision", dtype, "--channels_last", str(channels_last).lower()]
    if strategy != "allreduce":
        argv += ["--overlap", str(overlap).lower(), "--exchange", exchange]
    if graphs:
        argv += ["--cuda_graphs", "true"]
    argv += ["--metrics_dir", str(tmp / "metrics"), "--checkpoint_dir", str(tmp / "checkpoints")]
    argv += app_flags(job_paths(tmp))
    if role != "worker" or args.profile_steps <= 0:
        return [sys.executable, "-m", "app", *argv]
    trace = ["--after", str(timed(args)), "--steps", str(args.profile_steps), "--out", str(trace_path(tmp, rank))]
    return [sys.executable, "-m", "bench.cuda_trace", *trace, "--", *argv]


def batches_done(train: list[dict[str, Any]]) -> list[int]:
    """The batches a worker had done at each of its `train` records (epoch, batch within it): a
    worker reports at every epoch's last batch, so an epoch's length is the last batch of any
    epoch it finished (a run that did not resume: every epoch from batch 1)."""
    if not train:
        return []
    first, last = train[0]["epoch"], train[-1]["epoch"]
    length = max((r["batch"] for r in train if r["epoch"] < last), default=0)
    return [(r["epoch"] - first) * length + r["batch"] for r in train]


def trace_path(tmp: Path, rank: int) -> Path:
    return tmp / f"worker{rank}.trace.json"


class Measured(list):
    """Each worker's `train` record times (a list per worker), with the batch each one ended
    (`numbers`) and the GPU's idle share over the profiled batches (`gpu_idle`, None on a CPU)."""

    numbers: list[list[int]]
    gpu_idle: float | None = None


def run_app(case: tuple[str, str, int, str], args: argparse.Namespace, images: Path, logs: Path) -> Measured:
    """One case as processes; each worker's `train` record times up to its last timed batch.
    Logs kept under `logs`."""
    workers, allreduce = case[2], case[1] == "allreduce"
    with tempfile.TemporaryDirectory(prefix="cuda-bench-") as name:
        tmp = Path(name)
        (tmp / "images").symlink_to(images)
        job_files(tmp)
        port = free_port()
        env = dict(os.environ, PYTHONPATH=harness.python_path(ROOT), PYTHONUNBUFFERED="1")
        procs = {}
        roles = ([] if allreduce else [("ps", 0)]) + [("worker", r) for r in range(1, workers + 1)]
        for role, rank in roles:
            who = "ps" if role == "ps" else f"worker{rank}"
            out = open(logs / f"{label(case).replace('+', '_')}.{who}.log", "w")
            # two DDP ranks on one GPU: NCCL takes ranks of distinct host ids for distinct hosts
            mine = dict(env, NCCL_HOSTID=f"cuda-bench-{who}") if allreduce and workers > 1 else env
            procs[who] = subprocess.Popen(
                app_argv(role, rank, case, args, port, tmp), env=mine, cwd=tmp, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + args.timeout
        if args.pyspy:
            spy = (args, case, tmp / "metrics" / "worker1.jsonl", {w: p.pid for w, p in procs.items()}, logs)
            threading.Thread(target=_spy, args=spy, daemon=True).start()
        try:
            for who, p in procs.items():
                code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if code != 0:
                    raise RuntimeError(f"{who} exited {code} (see its log)")
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        times = Measured()
        times.numbers = []
        for rank in range(1, workers + 1):
            lines = (tmp / "metrics" / f"worker{rank}.jsonl").read_text().splitlines()
            records = [json.loads(line) for line in lines if line.strip()]
            train = [r for r in records if r["event"] == "train"]
            numbered = [(n, r) for n, r in zip(batches_done(train), train) if n <= timed(args)]
            times.append([r["time"] for _, r in numbered])
            times.numbers.append([n for n, _ in numbered])
        times.gpu_idle = cuda_trace.idle_share(cuda_trace.read([trace_path(tmp, r) for r in range(1, workers + 1)]))
        return times


def _spy(
    args: argparse.Namespace, case: tuple[str, str, int, str], progress: Path, pids: dict[str, int], logs: Path
) -> None:
    """`--pyspy`: once worker1 is past its warm-up, py-spy records every process of the case
    (all threads, idle ones too, native frames) for `--spy-seconds`, raw, under `logs`."""
    while not progress.exists() or progress.read_text().count('"event": "train"') < args.warmup:
        time.sleep(0.2)
    for who, pid in pids.items():
        out = logs / f"{label(case).replace('+', '_')}.{who}.pyspy.txt"
        argv = [args.pyspy, "record", "--native", "--idle", "--threads", "-r", "250", "-d", str(args.spy_seconds)]
        subprocess.Popen([*argv, "--format", "raw", "-o", str(out), "-p", str(pid)], stdout=subprocess.DEVNULL)


def row(case: tuple[str, str, int, str], times: list[list[float]], args: argparse.Namespace) -> dict[str, Any]:
    """A case's figures from its workers' batch times (`Measured`: with the batch each ended
    and the GPU's idle share; plain lists: batches 1, 2, 3...)."""
    precision, system, workers, exchange = case
    steady = gpu_report.steady_step(times, args.warmup, getattr(times, "numbers", None))
    samples = sum(args.batch / s for s in steady["per_worker_step_s"])
    idle = getattr(times, "gpu_idle", None)
    return dict(
        precision=precision,
        system=system,
        workers=workers,
        exchange=exchange,
        samples_per_s=samples,
        gpu_idle=idle,
        **steady,
    )


def table(rows: list[dict[str, Any]]) -> str:
    """Per precision: each case's s/step, x its compute alone, samples/s, x the GPU alone's and
    the GPU's idle share over the profiled batches."""
    out = [f"  {'case':<44} {'s/step':>7} {'x compute':>9} {'samples/s':>9} {'x GPU':>6} {'GPU idle':>8}"]
    for precision in PRECISIONS:
        alone = next((r for r in rows if r["precision"] == precision and r["system"] == "compute"), None)
        for r in (r for r in rows if r["precision"] == precision):
            if r["system"] == "compute":
                name = f"{precision}: compute alone (plain PyTorch)"
            else:
                name = f"{precision}: {r['system']}, {r['workers']} worker{'s' * (r['workers'] > 1)}"
                name += ", over the socket" if r["exchange"] == "transport" else ""
            vs = f"{r['step_s'] / alone['step_s']:.2f}x" if alone else "-"
            gpu = f"{r['samples_per_s'] / alone['samples_per_s']:.2f}x" if alone else "-"
            idle = f"{100 * r['gpu_idle']:.0f}%" if r.get("gpu_idle") is not None else "-"
            out.append(f"  {name:<44} {r['step_s']:>7.4f} {vs:>9} {r['samples_per_s']:>9.0f} {gpu:>6} {idle:>8}")
    return "\n".join(out)


def gpu_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else "none (cpu)"


def main(args: argparse.Namespace) -> int:
    started, failures, rows = time.monotonic(), [], []
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    where = dict(harness.machine(), gpu=gpu_name(args.device))
    print(f"bench cuda: {where}", file=sys.stderr, flush=True)

    def save() -> None:
        doc = dict(kind="cuda", schema=1, machine=where, settings=vars(args), rows=rows, failures=failures)
        (out / "cuda.json").write_text(json.dumps(doc, indent=2))
        (out / "cuda.txt").write_text(table(rows) + "\n")

    with tempfile.TemporaryDirectory(prefix="cuda-images-") as images:
        write_images(Path(images), args.classes, args.per_class, round(args.image_size * 8 / 7))
        for precision in PRECISIONS:
            times = harness.attempt(
                "bench cuda", f"{precision} compute alone", functools.partial(compute_alone, precision, args), failures
            )
            if times:
                rows.append(row((precision, "compute", 1, "-"), times, args))
                save()
        cases = CASES if not args.only else [c for c in CASES if label(c) in args.only]
        for case in cases:
            if time.monotonic() - started > args.budget:
                failures.append(f"{label(case)}: not run (past --budget {args.budget:.0f} s)")
                continue
            name = label(case)
            times = harness.attempt(
                "bench cuda", name, functools.partial(run_app, case, args, Path(images), out / "logs"), failures
            )
            if times:
                try:
                    rows.append(row(case, times, args))
                except ValueError as error:
                    failures.append(f"{name}: {error}")
            save()
    where["loadavg_end"] = os.getloadavg()
    save()
    print(f"GPU: {where['gpu']}; ResNet-18, batch {args.batch}, {args.image_size} px; medians of {args.steps} steps")
    print(table(rows))
    print(f"{time.monotonic() - started:.0f} s")
    if failures:
        print("failed cases:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "cuda",
        help="ResNet-18 on a real GPU: compute alone vs the app (async, overlap, sync; 1, 2 workers; CUDA graphs)",
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: try the plumbing small, no GPU")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--image-size", dest="image_size", type=int, default=224)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", dest="per_class", type=int, default=128, help="JPEGs per class")
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for one case")
    p.add_argument("--budget", type=float, default=480.0, help="start no case after this many seconds")
    p.add_argument("--only", nargs="*", default=[], help="cases by label, e.g. fp32-overlap-1-auto")
    p.add_argument(
        "--profile-steps",
        dest="profile_steps",
        type=int,
        default=5,
        help="batches each worker runs under torch.profiler after the timed ones (the GPU idle column; 0: none)",
    )
    p.add_argument("--pyspy", default="", help="a py-spy binary: profile each process of each case after its warm-up")
    p.add_argument("--spy-seconds", dest="spy_seconds", type=int, default=6)
    p.add_argument("--out", default="cuda-bench", help="directory: cuda.json, cuda.txt, logs/")
