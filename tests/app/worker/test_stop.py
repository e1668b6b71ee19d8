"""A worker told to stop (SIGTERM: a scale down) at any moment of its life leaves with status 0
and one line: while torch loads, while it starts, as it enters the job's transport, as it joins, just
after, while it trains, as it ends. Real processes of one job; each worker sends itself the signal at its moment.

Before: SIGTERM while torch loaded killed the worker (-15); while its modules loaded it ended
with a SystemExit or `ImportError: initialization failed` (143 or 1); as it joined and just
after, 143 (the PS counted a drop); as it ended, 143 between its finish and its `end` record.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app_testkit import REPO, app_env, digits, finished, free_port, start_app, wait_for

# Each worker sends itself SIGTERM at one moment of its life, then runs on as it would.
AT_A_MOMENT = """
import os, signal, sys

moment = sys.argv[1]


def sigterm():
    os.kill(os.getpid(), signal.SIGTERM)


class Importing:  # SIGTERM as a module starts importing
    def __init__(self, name):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            sys.meta_path.remove(self)
            sigterm()
        return None


def before(cls, name, call=1):  # SIGTERM as the call-th call of cls.name starts
    original, calls = getattr(cls, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            sigterm()
        return original(*args, **kwargs)

    setattr(cls, name, wrapped)


if moment == "loading-torch":
    sys.meta_path.insert(0, Importing("torch"))
elif moment == "starting":
    sys.meta_path.insert(0, Importing("app.worker.process"))
else:
    from app.exchange import transport
    from app.worker.channels import PSChannel
    from app.worker.trainer import Trainer

    if moment == "entering":  # the job's transport, before its connection to the PS is up
        before(transport, "session")
    elif moment == "joining":
        before(PSChannel, "join")
    elif moment == "joined":
        before(Trainer, "__init__")
    elif moment == "training":
        before(Trainer, "push_and_pull", call=3)
    elif moment == "ending":
        before(PSChannel, "finish")
from app.__main__ import main

sys.exit(main(sys.argv[2:]))
"""
MOMENTS = ("loading-torch", "starting", "entering", "joining", "joined", "training", "ending")
LEFT = ("entering", "joining", "joined", "training")  # joined: the PS records them as left


def _records(path: Path, event: str) -> list[dict]:
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == event]


def _until(what: str, check, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_worker_stopped_at_any_moment_of_its_life_exits_0_with_one_line(tmp_path):
    metrics = tmp_path / "metrics"
    ranks = {moment: rank for rank, moment in enumerate(MOMENTS, start=2)}
    common = [
        *("--world_size", "2", "--max_workers", str(1 + len(MOMENTS))),
        *("--master_addr", "127.0.0.1", "--master_port", str(free_port())),
        *("--metrics_dir", str(metrics), "--checkpoint_dir", str(tmp_path / "checkpoints")),
        *digits(lr=0.05, num_epochs=100),
        *("--rpc_timeout", "60", "--join_timeout", "240", "--seed", "3", "--eval_every", "100000"),
    ]
    procs = {"ps": start_app(tmp_path, "ps", ["ps", *common])}
    try:
        procs["worker1"] = start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common])
        for moment, rank in ranks.items():
            argv = ["worker", "--rank", str(rank), *common]
            if moment == "ending":
                argv += ["--max_steps", "3"]  # its own end comes long before the job's
            with open(tmp_path / f"{moment}.out", "w") as out, open(tmp_path / f"{moment}.err", "w") as err:
                procs[moment] = subprocess.Popen(
                    [sys.executable, "-c", AT_A_MOMENT, moment, *argv],
                    stdout=out,
                    stderr=err,
                    env=app_env(),
                    cwd=REPO,
                )
        wait_for({m: procs[m] for m in MOMENTS}, 420, "the stopped workers")
        # worker1 trains on; stopped too, it leaves, and the run ends (the `ending` worker finished)
        _until("worker1 trains", lambda: len(_records(metrics / "worker1.jsonl", "train")) > 0)
        procs["worker1"].terminate()
        wait_for(procs, 240)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    ended = {name: finished(tmp_path, name, proc) for name, proc in procs.items()}
    for name, p in ended.items():
        assert p.returncode == 0, f"{name} exited {p.returncode}:\n{p.stderr[-3000:]}"
        assert "Traceback" not in p.stderr and " ERROR " not in p.stderr, f"{name}:\n{p.stderr[-3000:]}"
    for moment in MOMENTS:
        said = [line for line in ended[moment].stderr.splitlines() if "SIGTERM" in line]
        assert len(said) == 1, f"{moment}:\n{ended[moment].stderr[-3000:]}"
        worker = f"worker{ranks[moment]}"
        if moment in ("loading-torch", "starting"):
            assert said[0].endswith(f"{worker}: stopped (SIGTERM) before it joined the job; nothing to leave")
        elif moment in LEFT:
            assert f"{worker} left the job after " in said[0] and said[0].endswith(" pushes (SIGTERM)"), said
        else:
            assert said[0].endswith("; stopped (SIGTERM) as it ended"), said
    ps = metrics / "ps.jsonl"
    joined = {r["worker"] for r in _records(ps, "join")}
    left = {r["worker"] for r in _records(ps, "left")}
    assert not joined & {f"worker{ranks[m]}" for m in ("loading-torch", "starting")}
    assert left == {"worker1"} | {f"worker{ranks[m]}" for m in LEFT}
    assert _records(ps, "drop") == []  # a leave is not a failure
    ending = _records(metrics / f"worker{ranks['ending']}.jsonl", "end")
    assert ending and ending[0]["step"] == 3  # its finish and its `end` record, whole
    assert _records(ps, "end")  # the run ended: every rank finished or left, one finished
