"""The job on its own transport as real processes on one host: it trains over
TCP with every message encrypted, and a sharded PS over UNIX sockets; a killed worker is dropped
and its next process rejoins; a killed PS makes its workers exit 1 at once, with one line."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from app.training.metrics import read

from app_testkit import DIGITS, digits, final_accuracy, job_args, run_cluster, secret_file, start_app

pytestmark = pytest.mark.slow


def zmq_job(tmp_path: Path, *extra: str) -> list[str]:
    return [*DIGITS, "--secret_file", str(secret_file(tmp_path)), *extra]


def test_two_workers_learn_digits_over_tcp_with_every_tensor_encrypted(tmp_path):
    """--exchange transport: the push's values and the reply's state cross the socket (CURVE)."""
    procs = run_cluster(tmp_path, workers=2, args=zmq_job(tmp_path, "--exchange", "transport"), timeout=180)
    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr[-3000:]}"
        assert "Traceback" not in p.stderr, p.stderr
    assert final_accuracy(procs["ps"].stdout) >= 0.90
    assert "exchange over the job's transport (--exchange transport)" in procs["ps"].stderr


def test_a_sharded_ps_over_unix_sockets_learns_digits_and_leaves_no_socket(tmp_path):
    sockets = tmp_path / "sockets"
    args = zmq_job(tmp_path, "--shards", "2", "--socket_dir", str(sockets))
    procs = run_cluster(tmp_path, workers=2, args=args, timeout=180, shards=2)
    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr[-3000:]}"
    assert final_accuracy(procs["ps"].stdout) >= 0.90
    assert "worker1: exchange with ps1 through shared memory" in procs["worker1"].stderr
    assert sockets.stat().st_mode & 0o777 == 0o700 and list(sockets.iterdir()) == []


def _until(what: str, check, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {seconds:.0f} s")
        time.sleep(0.1)


def test_a_killed_worker_rejoins_and_a_killed_ps_ends_its_workers_at_once(tmp_path):
    common = [
        *job_args(tmp_path, 3),
        *digits(lr=0.05, num_epochs=400, eval_every=100, rpc_timeout=600, join_timeout=600, seed=1),
        *("--secret_file", str(secret_file(tmp_path))),
    ]
    metrics = tmp_path / "metrics"
    procs = {"ps": start_app(tmp_path, "ps", ["ps", *common])}
    for rank in (1, 2):
        procs[f"worker{rank}"] = start_app(tmp_path, f"worker{rank}", ["worker", "--rank", str(rank), *common])
    try:
        trains = lambda name: any(r["event"] == "train" for r in read(metrics / f"{name}.jsonl"))  # noqa: E731
        _until("worker2 trains", lambda: (metrics / "worker2.jsonl").exists() and trains("worker2"))
        procs["worker2"].send_signal(signal.SIGKILL)
        procs["worker2"].wait()
        # dropped at the PS's next ping (its connection is gone), not after --rpc_timeout (600 s)
        _until("worker2 dropped", lambda: any(r["event"] == "drop" for r in read(metrics / "ps.jsonl")), 60)
        procs["worker2_r2"] = start_app(tmp_path, "worker2_r2", ["worker", "--rank", "2", *common])
        _until(
            "worker2_r2 joins",
            lambda: any(r["event"] == "join" and r["worker"] == "worker2_r2" for r in read(metrics / "ps.jsonl")),
        )
        procs["ps"].send_signal(signal.SIGKILL)
        procs["ps"].wait()
        for name in ("worker1", "worker2_r2"):  # at once (the connection closed), not at --rpc_timeout
            assert procs[name].wait(timeout=60) == 1
            errors = [line for line in (tmp_path / f"{name}.err").read_text().splitlines() if " ERROR " in line]
            assert len(errors) == 1 and "lost the parameter server at 127.0.0.1:" in errors[0], errors
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
