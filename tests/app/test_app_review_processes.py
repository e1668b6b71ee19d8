"""Regression tests for defects found in review that are about processes, exits and messages."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from app_testkit import app_env, finished, free_port, run_app, start_app, wait_for

DIGITS = [
    "--model",
    "cnn",
    "--dataset",
    "digits",
    "--batch_size",
    "32",
    "--lr",
    "0.1",
    "--eval_every",
    "100000",
    "--checkpoint_every",
    "0",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv,env,message",
    [
        (["ps", "--lr", "nan"], {}, "app: error: --lr: nan is not a finite number"),
        (["worker"], {"PSC_RPC_TIMEOUT": "inf"}, "app: error: PSC_RPC_TIMEOUT: inf is not a finite number"),
        (["ps"], {"OMP_NUM_THREADS": "4,2"}, "app: error: OMP_NUM_THREADS: '4,2' is not a positive integer"),
        (["worker"], {"OMP_NUM_THREADS": "0"}, "app: error: OMP_NUM_THREADS: '0' is not a positive integer"),
    ],
)
def test_non_finite_flags_and_bad_omp_num_threads_exit_2_with_one_line(argv, env, message):
    result = run_app(*argv, env=app_env(**env), timeout=30)
    assert result.returncode == 2 and result.stderr.strip().startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _wait_for_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        if time.monotonic() > deadline:
            pytest.fail(f"{text!r} not in {path.name} within {timeout} s:\n{path.read_text()}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_replaced_incarnations_push_ends_it_with_status_2_and_one_line(tmp_path):
    common = [
        "--world_size",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "--metrics_dir",
        str(tmp_path / "metrics"),
        "--checkpoint_dir",
        str(tmp_path / "ckpt"),
        "--rpc_timeout",
        "3",
        "--join_timeout",
        "20",
        "--num_epochs",
        "1000",
        *DIGITS,
    ]
    procs = {"ps": start_app(tmp_path, "ps", ["ps", *common])}
    try:
        _wait_for_text(tmp_path / "ps.err", "ps joined the job", 60)
        # The old process's own timeout is long: a push in flight when it is stopped must
        # not time out on resuming (that is "lost the PS", exit 1); what it meets is the
        # PS's refusal of a replaced process.
        procs["old"] = start_app(tmp_path, "old", ["worker", "--rank", "1", *common, "--rpc_timeout", "60"])
        _wait_for_text(tmp_path / "old.out", "Epoch: 1 | Batch: 10 |", 60)
        procs["old"].send_signal(signal.SIGSTOP)  # frozen: its ping times out, the PS drops it
        _wait_for_text(tmp_path / "ps.err", "dropped worker1 (rank 1)", 30)
        procs["new"] = start_app(tmp_path, "new", ["worker", "--rank", "1", *common])
        _wait_for_text(tmp_path / "ps.err", "worker1_r2 (rank 1) joined", 60)
        procs["old"].send_signal(signal.SIGCONT)  # its next push comes from a replaced process
        wait_for({"old": procs["old"]}, 30, "the replaced worker")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    old = finished(tmp_path, "old", procs["old"])
    errors = [line for line in old.stderr.splitlines() if "error" in line.lower()]
    assert old.returncode == 2, old.stderr
    assert errors == ["app: error: worker1 was replaced by worker1_r2 for rank 1; exiting"], old.stderr
