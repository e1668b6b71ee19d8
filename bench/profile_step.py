"""Where a PS step goes: the app itself (`python -m app ps|worker`), timed and profiled.

`python -m bench.profile_step app --strategy sync [--overlap] [--pyspy DIR]`
starts a PS and `--workers` workers as the user would (synthetic 3x32x32 data,
one thread per process), and reports the steady-state seconds per step between
two of worker1's progress records (batches `--from` and `--to`), with each
process's CPU seconds per step over that window. With `--pyspy DIR`, py-spy
records the PS and worker1 (native frames) over the same window.

`python -m bench.profile_step compute` times a compute-only step (forward and
backward, no PS) in `--workers` processes at once, under the same conditions.

The app's processes talk over UNIX sockets in the run's scratch directory, proving a secret
made there (--socket_dir, --secret_file), as `make local` runs them.

`--app-path DIR` runs the app/ under DIR instead of this checkout's (a baseline); an app from
before the job's own transport (torch RPC) is not supported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.constants import timed
from bench.procs import app_flags, cpu_seconds, free_port, job_files

HERE = Path(__file__).resolve().parent.parent


def _env(app_path: Path) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=str(app_path),
        OMP_NUM_THREADS="1",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONUNBUFFERED="1",
    )


def _progress(path: Path) -> dict[int, float]:
    """batch -> time of worker1's `train` records so far."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == "train":
            out[record["batch"]] = record["time"]
    return out


def run_app(args: argparse.Namespace) -> dict[str, Any]:
    """PS + workers; seconds and CPU seconds per step between batches args.start and args.end
    (then they are stopped: the run's end, evaluation and checkpoint, is not measured)."""
    tmp = Path(tempfile.mkdtemp(prefix="profile-step-"))
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Any] = {}
    try:
        _start_app(args, tmp, procs, logs)
        marks = _watch(args, tmp, procs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for f in logs.values():
            f.close()
        shutil.rmtree(tmp, ignore_errors=True)
    (t0, cpu0), (t1, cpu1) = marks[args.start], marks[args.end]
    steps = args.end - args.start
    cpu = {n: (cpu0[n], cpu1[n]) for n in procs}  # None for a process that had exited
    return {
        "s_per_step": round((t1 - t0) / steps, 4),
        "cpu_s_per_step": {
            n: round((b - a) / steps, 4) for n, (a, b) in cpu.items() if a is not None and b is not None
        },
    }


def _app_flags(args: argparse.Namespace, port: int, tmp: Path) -> list[str]:
    """The flags the PS and every worker get (synthetic data; no evaluation, no checkpoint in the window)."""
    return [
        "--world_size",
        str(args.workers + 1),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "--model",
        args.model,
        "--dataset",
        "synthetic",
        "--batch_size",
        str(args.batch),
        "--strategy",
        args.strategy,
        "--overlap",
        str(args.overlap),
        "--compress",
        args.compress,
        "--max_steps",
        str(args.end + 20),
        "--num_epochs",
        "50",
        "--log_every",
        str(args.every),
        "--eval_every",
        "100000",
        "--checkpoint_every",
        "0",
        "--checkpoint_dir",
        str(tmp / "ckpt"),
        "--metrics_dir",
        str(tmp / "metrics"),
        "--rpc_timeout",
        "120",
        "--momentum",
        str(args.momentum),
    ]


def _start_app(args: argparse.Namespace, tmp: Path, procs: dict[str, subprocess.Popen], logs: dict[str, Any]) -> None:
    """Starts the PS (rank 0) and args.workers workers as `python -m app`, each writing tmp/<name>.log;
    fills `procs` and `logs` as it goes, so the caller can clean up after a failed start."""
    common = _app_flags(args, free_port(), tmp) + app_flags(job_files(tmp))
    env = _env(Path(args.app_path))
    for rank in range(args.workers + 1):
        role, name = ("ps", "ps") if rank == 0 else ("worker", f"worker{rank}")
        argv = [sys.executable, "-m", "app", role, *common] + (["--rank", str(rank)] if rank else [])
        logs[name] = open(tmp / f"{name}.log", "w")
        procs[name] = subprocess.Popen(argv, stdout=logs[name], stderr=subprocess.STDOUT, env=env, cwd=tmp)


def _watch(
    args: argparse.Namespace, tmp: Path, procs: dict[str, subprocess.Popen]
) -> dict[int, tuple[float, dict[str, float | None]]]:
    """batch -> (its time, each process's CPU seconds) when worker1 records batches args.start and
    args.end; py-spy (args.pyspy) starts at args.start and has finished when this returns."""
    metrics = tmp / "metrics" / "worker1.jsonl"
    marks: dict[int, tuple[float, dict[str, float | None]]] = {}
    spies: list[subprocess.Popen] = []
    deadline = time.monotonic() + args.timeout
    while len(marks) < 2:
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs.values()):
            raise RuntimeError(
                "the run failed: " + "; ".join(f"{n}: {(tmp / f'{n}.log').read_text()[-400:]}" for n in procs)
            )
        seen = _progress(metrics)
        for batch in (args.start, args.end):
            if batch in seen and batch not in marks:
                marks[batch] = (seen[batch], {n: _cpu(p.pid) for n, p in procs.items()})
                if batch == args.start and args.pyspy:
                    spies = _spy(args, procs, marks)
        time.sleep(0.02)
    for spy in spies:
        spy.wait(timeout=60)
    return marks


def _cpu(pid: int) -> float | None:
    """The process's CPU seconds so far; None once it has exited."""
    try:
        return cpu_seconds(pid)
    except (FileNotFoundError, ProcessLookupError):
        return None


def _spy(args: argparse.Namespace, procs: dict[str, subprocess.Popen], marks: Any) -> list[subprocess.Popen]:
    out = Path(args.pyspy)
    out.mkdir(parents=True, exist_ok=True)
    label = args.strategy + ("-overlap" if args.overlap else "")
    spies = []
    for name in ("ps", "worker1"):
        argv = [
            str(Path(sys.executable).parent / "py-spy"),
            "record",
            "--native",
            "-r",
            "200",
            "-d",
            str(args.spy_seconds),
            "--format",
            "raw",
            "-o",
            str(out / f"{label}-{name}.txt"),
            "-p",
            str(procs[name].pid),
        ]
        spies.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


COMPUTE = """
import sys, time, torch
from app.training import models
torch.manual_seed(0)
model = models.build(sys.argv[1], 3, 10, 0)
model.train()
x, y = torch.randn(int(sys.argv[2]), 3, 32, 32), torch.randint(0, 10, (int(sys.argv[2]),))
loss_fn = torch.nn.CrossEntropyLoss()
def step():
    model.zero_grad(set_to_none=False)
    loss_fn(model(x), y).backward()
for _ in range(5):
    step()
t0, c0 = time.perf_counter(), time.process_time()
for _ in range(int(sys.argv[3])):
    step()
print((time.perf_counter() - t0) / int(sys.argv[3]), (time.process_time() - c0) / int(sys.argv[3]))
"""


def run_compute(args: argparse.Namespace) -> dict[str, Any]:
    """Forward + backward in args.workers processes at once: seconds per step of each."""
    env = _env(Path(args.app_path))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", COMPUTE, args.model, str(args.batch), str(args.steps)],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(args.workers)
    ]
    times = [[float(v) for v in p.communicate(timeout=args.timeout)[0].split()] for p in procs]
    return {"s_per_step": [round(wall, 4) for wall, _ in times], "cpu_s_per_step": [round(cpu, 4) for _, cpu in times]}


def _cpu_ms(f: Any, repeats: int) -> float:
    """CPU milliseconds of one call of `f` (median of `repeats`, after one warm-up call)."""
    return round(1000 * timed(f, repeats, clock=time.process_time), 2)


def run_parts(args: argparse.Namespace) -> dict[str, Any]:
    """CPU milliseconds of each piece of a step, in this process on one thread: the worker's
    and the PS's copies and arithmetic as the app has them now, and as they were (`was:`)."""
    import torch

    from app.ps.members.members import MembersConfig
    from app.ps.policies import PolicyConfig
    from app.ps.server import ParameterServer, ServerConfig
    from app.ps.state import StateConfig
    from app.runtime import machine
    from app.training import models
    from app.training.flat import FlatModel

    machine.keep_freed_memory()
    torch.set_num_threads(1)
    model = models.build(args.model, 3, 10, 0)
    model.train()
    flat = FlatModel(model)
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    config = ServerConfig(
        StateConfig(lr=0.01, momentum=args.momentum), MembersConfig(args.workers), PolicyConfig(strategy="sync")
    )
    server = ParameterServer(models.build(args.model, 3, 10, 0), config)
    for rank in range(1, args.workers + 1):
        server.join(rank, f"worker{rank}")
    messages = [torch.randn(flat.size) * 1e-3 for _ in range(args.workers)]
    return {
        "threads": torch.get_num_threads(),
        "floats": flat.size,
        "cpu_ms": {**_worker_parts(args, model, flat, x, y), **_ps_parts(args, server, flat, messages)},
    }


def _worker_parts(args: argparse.Namespace, model: Any, flat: Any, x: Any, y: Any) -> dict[str, float]:
    """The worker's pieces: its forward and backward on (x, y), and the copies around its push and pull."""
    import torch

    r = args.repeats

    def compute() -> None:
        with flat.writing_grads():  # as the worker does: each gradient written into the message once
            torch.nn.functional.cross_entropy(model(x), y).backward()

    return {
        "worker: forward+backward": _cpu_ms(compute, max(3, r // 4)),
        "worker was: zero grads (before autograd added into them)": _cpu_ms(flat.zero_grads, r),
        "worker: pack message (buffers behind grads)": _cpu_ms(flat.pack_message, r),
        "worker --overlap: flip message buffers": _cpu_ms(flat.flip, r),
        "worker --overlap was: clone the message": _cpu_ms(flat.message.clone, r),
        "worker: adopt the reply": _cpu_ms(lambda: flat.adopt(torch.empty(flat.size)), r),
    }


def _ps_parts(args: argparse.Namespace, server: Any, flat: Any, messages: list[Any]) -> dict[str, float]:
    """The sync PS's pieces on the workers' `messages`: checks, average, SGD, reply; and a whole round."""
    import torch

    from app.exchange.wire import Push, all_finite
    from app.ps.policies import RoundPolicy

    assert isinstance(server.policy, RoundPolicy)  # a sync server: its rounds average
    average = server.policy.average

    reply = torch.empty(flat.size)
    n, r, state = flat.num_params, args.repeats, server.state

    def old_step() -> None:  # what a sync round did: stack + mean, optimizer.step, copy for the reply
        mean = torch.stack(messages).mean(0)
        state.optimizer.step(mean[:n])
        state.vector[n:].copy_(mean[n:])
        reply.copy_(state.vector)

    def locked(f: Any) -> Any:
        def call() -> None:
            with server._lock:
                f()

        return call

    def round_() -> None:
        futures = [server.submit(Push(rank, "", server.version), m) for rank, m in enumerate(messages, start=1)]
        futures[-1].wait()

    return {
        "ps: NaN/inf check of a push": _cpu_ms(lambda: all_finite(messages[0]), r),
        "ps was: NaN/inf check (isfinite.all)": _cpu_ms(lambda: bool(torch.isfinite(messages[0]).all()), r),
        f"ps: average {args.workers} pushes": _cpu_ms(lambda: average(messages), r),
        f"ps was: average {args.workers} pushes (stack.mean)": _cpu_ms(lambda: torch.stack(messages).mean(0), r),
        "ps: SGD into the reply buffer": _cpu_ms(
            locked(lambda: state.step(messages[0], into=server.replies.take(0))), r
        ),
        "ps was: SGD in place + reply copy": _cpu_ms(
            locked(lambda: (state.step(messages[0]), reply.copy_(state.vector))), r
        ),
        f"ps: sync round of {args.workers} (checks, average, SGD, reply)": _cpu_ms(round_, r),
        f"ps was: sync round of {args.workers} (checks, stack.mean, SGD, reply copy)": _cpu_ms(
            lambda: ([bool(torch.isfinite(m).all()) for m in messages], old_step()), r
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["app", "compute", "parts"])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--strategy", default="async")
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--compress", default="none")
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--from", dest="start", type=int, default=20)
    parser.add_argument("--to", dest="end", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="worker1's progress record every K batches")
    parser.add_argument("--steps", type=int, default=30, help="compute: timed steps")
    parser.add_argument("--pyspy", default="", help="a directory for py-spy's raw profiles of ps and worker1")
    parser.add_argument("--spy-seconds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=12, help="parts: calls timed per piece")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--app-path", default=str(HERE))
    args = parser.parse_args(argv)
    result = {"app": run_app, "compute": run_compute, "parts": run_parts}[args.mode](args)
    print(
        json.dumps(
            {
                "mode": args.mode,
                "strategy": args.strategy,
                "overlap": args.overlap,
                "model": args.model,
                "app": args.app_path,
                **result,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
