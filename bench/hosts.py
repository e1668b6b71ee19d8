"""`python -m bench hosts [--rate 50mbit] [--delay 1ms] [--cases ...] [--target P] [--json FILE]`:
each strategy's time to a held-out quality when the PS and the workers sit on two hosts joined
by a slow link (root; `ip`, `tc`, `nsenter`).

Two network namespaces joined by a veth pair stand for two hosts (bench/wire.py's link); `tc
netem` gives both ends a rate and a delay. The PS runs in one, the workers in the other, over
the job's TCP transport (CURVE, as across real hosts; never its shared memory); under allreduce
worker1 (DDP's rank 0 and its store) takes the PS's side. The job is configs/cpu-lm.yaml (a
character-level transformer, 2 workers, --steps batches each), each case one strategy:

    async, sync, allreduce          a push (or an allreduce) of the whole gradient every batch
    diloco-h4, -h16, -h64           diloco at local_steps 4, 16, 64
    diloco-h16-slow                 diloco with worker2 slowed (stopped for half of each 100 ms)
    diloco_async-h16-slow           diloco_async, the same slowed worker2

Each row: the held-out perplexity at the end, the wall time from the workers' joining to their
end, the time to reach the target perplexity (by default the first case's final one: async's),
read from the PS's evaluations (about a dozen a run), and the bytes that crossed the link both
ways (the veth's counters). The namespaces are deleted however the run ends (bench/wire.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import harness
from bench.wire import (
    ADDRESSES,
    ROOT,
    Link,
    LinkFailed,
    _die_with_parent,
    _terminated_as_interrupted,
    rate_bits,
    refusal,
    tools,
)

CONFIG = ROOT / "configs" / "cpu-lm.yaml"
PORT = 6241
EVALS = 12  # held-out evaluations a run, about
SLOW_PERIOD_S = 0.1  # a slowed worker is stopped for half of each period
# case -> (strategy, local_steps, slowed worker2)
CASES: dict[str, tuple[str, int, bool]] = {
    "async": ("async", 1, False),
    "sync": ("sync", 1, False),
    "allreduce": ("allreduce", 1, False),
    "diloco-h4": ("diloco", 4, False),
    "diloco-h16": ("diloco", 16, False),
    "diloco-h64": ("diloco", 64, False),
    "diloco-h16-slow": ("diloco", 16, True),
    "diloco_async-h16-slow": ("diloco_async", 16, True),
}

# A run of about 5 minutes on a 2-core CPU VM: async, and the two answers to it; `all` adds sync, allreduce,
# diloco at 4 and 64 local steps (about 12 minutes at 250 steps).
DEFAULT_CASES = ("async", "diloco-h16", "diloco-h16-slow", "diloco_async-h16-slow")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("hosts", help="time to a held-out quality per strategy over a slow link (root)")
    p.add_argument("--rate", default="50mbit", help="the link's rate each way (tc netem): %(default)s")
    p.add_argument("--delay", default="1ms", help="the link's one-way delay (tc netem): %(default)s")
    p.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated, in order, or all ({', '.join(CASES)}): %(default)s",
    )
    p.add_argument("--steps", type=int, default=200, help="batches each worker trains (max_steps): %(default)s")
    p.add_argument("--target", type=float, help="the held-out perplexity to reach (default: the first case's end)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a case may take")
    p.add_argument("--json", metavar="FILE", help="write the rows and settings here")
    p.add_argument("--keep", metavar="DIR", help="keep each case's logs and metrics in DIR/<case> (a new directory)")


def shape(link: Link, rate: str, delay: str) -> str:
    """Both ends' egress at `rate`, each packet `delay` late (netem); where the kernel has no
    netem, the rate alone (a token bucket, as bench wire shapes it). What the link is, in words."""
    for side in ADDRESSES:
        argv = [link.tools["tc"], "-n", link.ns(side), "qdisc", "replace", "dev", link.ns(side), "root", "netem"]
        argv += ["rate", rate, "delay", delay, "limit", "10000"]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0 and "unknown" in done.stderr and side == "s":
            link.shape(rate)
            return f"{rate} each way (a token bucket: this kernel has no netem, so no added delay)"
        if done.returncode != 0:
            raise LinkFailed(f"tc qdisc replace ... netem rate {rate} delay {delay}: {done.stderr.strip()}")
    return f"{rate}, {delay} each way"


def link_bytes(link: Link) -> int:
    """Bytes the server end of the veth has received and sent."""
    done = subprocess.run(
        [link.tools["ip"], "-n", link.ns("s"), "-s", "-j", "link", "show", "dev", link.ns("s")],
        capture_output=True,
        text=True,
        check=True,
    )
    stats = json.loads(done.stdout)[0]["stats64"]
    return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])


def environments(case: str, steps: int, run_dir: Path, ifname: str) -> list[tuple[str, str, list[str], dict[str, str]]]:
    """(name, side, argv, environment) of each process of `case`: configs/cpu-lm.yaml as `make
    local` starts it, over TCP between the namespaces."""
    from app.exchange import secret
    from orchestrator.job_secret import SECRET_ENV
    from orchestrator.topology.model import load
    from orchestrator.verbs import local

    strategy, local_steps, _ = CASES[case]
    t = load(CONFIG)
    total = steps * 2 if strategy in ("async", "diloco_async") else steps
    updates = -(-total // local_steps)
    train = dataclasses.replace(
        t.train, strategy=strategy, local_steps=local_steps, max_steps=steps, eval_every=max(1, updates // EVALS)
    )
    t = t.model_copy(update={"train": train, "ps": dataclasses.replace(t.ps, checkpoint_every=0)})
    run_dir.mkdir(parents=True)
    secret_file = secret.make(run_dir / "secret")
    out = []
    for spec in local.plan(t, port=PORT, run_dir=run_dir, ifname=ifname, run_id=case):
        env = {k: v for k, v in spec.env.items() if k != "PSC_SHM_DIR" and not k.startswith("MLFLOW_")}
        env.update(
            PSC_MASTER_ADDR=ADDRESSES["s"],
            PSC_EXCHANGE="transport",
            OMP_NUM_THREADS="1",
            PYTHONPATH=harness.python_path(ROOT),
        )
        env[SECRET_ENV] = str(secret_file)
        first = spec.name == ("worker1" if strategy == "allreduce" else "ps")
        out.append((spec.name, "s" if first else "c", spec.argv, env))
    return out


class Slowed:
    """A process stopped for half of each SLOW_PERIOD_S (SIGSTOP, SIGCONT) until `stop`: half speed."""

    def __init__(self, pid: int) -> None:
        self.pid, self.done = pid, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.done.wait(SLOW_PERIOD_S / 2):
                os.kill(self.pid, signal.SIGSTOP)
                self.done.wait(SLOW_PERIOD_S / 2)
                os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            return

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def run_case(link: Link, case: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """One job over the link; its row (without the time to the target)."""
    run_dir = Path(tmp, case)
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    slowed: Slowed | None = None
    before = link_bytes(link)
    try:
        for name, side, argv, env in environments(case, args.steps, run_dir, link.ns("c")):
            env["GLOO_SOCKET_IFNAME"] = link.ns(side)
            command = [link.tools["nsenter"], f"--net=/run/netns/{link.ns(side)}", *argv]
            with open(run_dir / f"{name}.log", "wb") as log:
                proc = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, cwd=ROOT, preexec_fn=_die_with_parent,
                )  # fmt: skip
            procs.append((name, proc))
            if name == "worker2" and CASES[case][2]:
                slowed = Slowed(proc.pid)
        deadline = time.monotonic() + args.timeout
        for name, proc in procs:
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"did not end within {args.timeout:.0f} s") from None
            if code != 0:
                tail = (run_dir / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"{name} exited {code}: {' | '.join(tail)}")
    finally:
        if slowed is not None:
            slowed.stop()
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    moved = link_bytes(link) - before
    return row(case, run_dir / "metrics", moved)


def row(case: str, metrics: Path, moved: int) -> dict[str, Any]:
    """The case's figures from the metrics records: its evaluations (time, perplexity), its end."""
    strategy = CASES[case][0]
    evaluator = metrics / ("worker1.jsonl" if strategy == "allreduce" else "ps.jsonl")
    records = [json.loads(line) for line in evaluator.read_text().splitlines() if line.strip()]
    joined = [r["time"] for r in records if r["event"] in ("join", "start")]
    evals = [(r["time"], r["perplexity"]) for r in records if r["event"] in ("eval", "end") and "perplexity" in r]
    if not evals:
        raise RuntimeError(f"{evaluator.name} holds no held-out perplexity")
    start = max(joined) if strategy != "allreduce" else min(joined)
    return {
        "case": case,
        "perplexity": evals[-1][1],
        "wall_s": round(evals[-1][0] - start, 1),
        "evals": [(round(t - start, 2), p) for t, p in evals],
        "mbytes": round(moved / 1e6, 1),
    }


def time_to(r: dict[str, Any], target: float) -> float | None:
    """Seconds from the start to the first evaluation at or below `target`; None: never reached."""
    return next((t for t, p in r["evals"] if p <= target), None)


def table(rows: list[dict[str, Any]], target: float) -> str:
    head = f"{'case':<24}{'perplexity':>11}{'wall s':>8}{f'to {target:.2f} s':>12}{'MB on the link':>16}"
    lines = [head]
    for r in rows:
        reached = time_to(r, target)
        cell = f"{reached:.1f}" if reached is not None else "never"
        lines.append(f"{r['case']:<24}{r['perplexity']:>11.3f}{r['wall_s']:>8.1f}{cell:>12}{r['mbytes']:>16.1f}")
    return "\n".join(lines)


def run(args: argparse.Namespace, found: dict[str, str], cases: list[str]) -> int:
    started, where = time.monotonic(), harness.machine()
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    link = Link(found)
    if args.keep:
        Path(args.keep).mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as scratch, _terminated_as_interrupted():
        tmp = args.keep or scratch
        try:
            link.stale()
            link.up()
            args.link = shape(link, args.rate, args.delay)
            for case in cases:
                done = harness.attempt("bench hosts", case, lambda case=case: run_case(link, case, args, tmp), failures)
                if done is not None:
                    rows.append(done)
        finally:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                link.down()
            finally:
                signal.signal(signal.SIGINT, previous)
    wall = time.monotonic() - started
    where["loadavg_end"] = os.getloadavg()
    target = args.target if args.target is not None else (rows[0]["perplexity"] if rows else 0.0)
    what = (
        f"configs/cpu-lm.yaml, 2 workers x {args.steps} batches; PS and workers on two namespaces joined by a "
        f"veth at {getattr(args, 'link', args.rate)}; target: held-out perplexity {target:.3f}"
        + (" (the first case's end)" if args.target is None else "")
    )
    text = table(rows, target) + "\n" + harness.run_line(what, 1, wall, where)
    for r in rows:
        r["to_target_s"] = time_to(r, target)
    return harness.close(
        text,
        failures,
        args.json,
        lambda: dict(kind="hosts", rows=rows, target=target, settings=vars(args), machine=where, failures=failures),
    )


def main(args: argparse.Namespace) -> int:
    found = tools()
    problem = refusal(found)
    cases = list(CASES) if args.cases == "all" else [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    try:
        rate_bits(args.rate)
    except ValueError as error:
        problem = problem or str(error).replace("--rates", "--rate")
    if unknown:
        problem = problem or f"--cases: {unknown[0]!r} is not one of {', '.join(CASES)}"
    if problem:
        print(f"python -m bench hosts: {problem}", file=sys.stderr)
        return 2
    try:
        return run(args, found, cases)
    except KeyboardInterrupt:
        print("python -m bench hosts: interrupted (namespaces deleted, processes ended)", file=sys.stderr)
        return 130
