"""`python -m app check`: the connectivity check as real processes on 127.0.0.1."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from app.config import UsageError, parse
from app.connectivity import rank_names

from app_testkit import app_env, finished, free_port, start_app, wait_for

ROUND_TRIP = re.compile(
    r"^check: (\S+)\s+rank (\d+)\s+host (\S+) (\S+): 4 B ([0-9.]+) ms, 8 MiB ([0-9.]+) ms, "
    r"([0-9.]+) GB/s$",
    re.MULTILINE,
)


def test_rank_names_follow_the_cluster():
    assert rank_names(3, "async") == ["ps", "worker1", "worker2"]
    assert rank_names(3, "sync") == ["ps", "worker1", "worker2"]
    assert rank_names(3, "allreduce") == ["worker1", "worker2", "worker3"]
    assert rank_names(5, "async", shards=2) == ["ps", "ps-shard1", "worker1", "worker2", "worker3"]


def test_check_takes_every_rank_from_0():
    assert parse(["check", "--rank", "0", "--world_size", "3"], {}).rank == 0
    assert parse(["check"], {"PSC_RANK": "2", "PSC_WORLD_SIZE": "3"}).rank == 2
    with pytest.raises(UsageError, match=r"--rank: 3 must be in 0..2 for the check"):
        parse(["check", "--rank", "3", "--world_size", "3"], {})


def start_ranks(
    tmp_path: Path, ranks: list[int], world_size: int, timeout: float, port: int | None = None
) -> dict[int, subprocess.Popen]:
    port = port or free_port()
    procs = {}
    for rank in ranks:
        procs[rank] = _popen(
            tmp_path,
            rank,
            [
                "--rank",
                str(rank),
                "--world_size",
                str(world_size),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "--rpc_timeout",
                str(timeout),
            ],
            app_env(),
        )
    return procs


def _popen(tmp_path: Path, rank: int, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return start_app(tmp_path, str(rank), ["check", *args], env)


def wait_all(tmp_path: Path, procs: dict[int, subprocess.Popen], within: float) -> dict[int, tuple[int, str, str]]:
    wait_for(procs, within, "the check")
    ended = {r: finished(tmp_path, str(r), p) for r, p in procs.items()}
    return {r: (e.returncode, e.stdout, e.stderr) for r, e in ended.items()}


@pytest.mark.slow
def test_three_ranks_pass_with_a_round_trip_per_rank(tmp_path: Path):
    out = wait_all(tmp_path, start_ranks(tmp_path, [0, 1, 2], 3, timeout=20), within=60)
    assert all(code == 0 for code, _, _ in out.values()), out
    report = out[0][1]
    rows = ROUND_TRIP.findall(report)
    assert [(name, int(rank)) for name, rank, *_ in rows] == [("worker1", 1), ("worker2", 2)], report
    for *_, small_ms, large_ms, gbps in rows:
        assert 0 < float(small_ms) and 0 < float(large_ms) and 0 < float(gbps)
    assert "check passed: 3 ranks" in report
    # Each other rank got the seed's tensor from the PS.
    assert "worker1 (rank 1)" in out[1][1] and "received tensor([42.]) from ps" in out[1][1]


@pytest.mark.slow
def test_a_missing_rank_fails_within_the_timeout_naming_it(tmp_path: Path):
    # wait_all fails the test if the ranks are still running after 40 s (a hang); the
    # 3 s the check waited is what it says it waited.
    out = wait_all(tmp_path, start_ranks(tmp_path, [0, 1], 3, timeout=3), within=40)
    code, stdout, stderr = out[0]
    assert code == 1, out
    assert re.search(r"^check failed: worker2 \(rank 2\) did not reach 127\.0\.0\.1:\d+ within 3 s", stderr, re.M), (
        stderr
    )
    # The rank that did come is told why, and stops too.
    assert out[1][0] == 1 and "called the check off: worker2 (rank 2) did not reach" in out[1][2]


@pytest.mark.slow
def test_a_rank_without_rank_0_fails_naming_the_address(tmp_path: Path):
    port = free_port()
    out = wait_all(tmp_path, start_ranks(tmp_path, [1], 2, timeout=2, port=port), within=30)
    code, _, stderr = out[1]
    assert code == 1
    assert f"check failed: worker1 (rank 1) could not reach ps (rank 0) at 127.0.0.1:{port} within 2 s" in stderr


@pytest.mark.slow
def test_allreduce_names_rank_0_worker1(tmp_path: Path):
    # Everything but the rank from the environment, as the render passes it.
    env = app_env(
        PSC_WORLD_SIZE="2",
        PSC_MASTER_ADDR="127.0.0.1",
        PSC_MASTER_PORT=str(free_port()),
        PSC_RPC_TIMEOUT="20",
        PSC_STRATEGY="allreduce",
    )
    procs = {rank: _popen(tmp_path, rank, ["--rank", str(rank)], env) for rank in (0, 1)}
    out = wait_all(tmp_path, procs, within=60)
    assert out[0][0] == 0 and out[1][0] == 0, out
    assert "worker1 (rank 0)" in out[0][1]
    assert [row[0] for row in ROUND_TRIP.findall(out[0][1])] == ["worker2"]
