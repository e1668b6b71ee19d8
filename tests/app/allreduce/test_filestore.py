"""The FileStore rendezvous of an allreduce job on one host (app/allreduce/filestore.py): a
store is found only while the rank 0 that made it lives, and a new rank 0 replaces a stale one."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from app.allreduce import filestore

from app_testkit import REPO

# A rank 0 in a process of its own: publishes, says where, then waits to be killed.
RANK0 = (
    "import sys, time; from app.allreduce import filestore; "
    "print(filestore.publish(sys.argv[1]), flush=True); time.sleep(600)"
)


def rank0(directory) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", RANK0, str(directory)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, p.stdout.readline().strip()


def test_a_store_is_found_only_while_its_rank_0_lives_and_the_next_one_is_fresh(tmp_path):
    private = tmp_path / "private"
    first, path = rank0(private)
    try:
        assert filestore.find(str(private), time.monotonic() + 5) == path
        assert oct(private.stat().st_mode & 0o777) == "0o700"
    finally:
        first.kill()
        first.wait()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no live rendezvous"):
        filestore.find(str(private), time.monotonic() + 0.5)  # its rank 0 is gone: stale
    assert time.monotonic() - started >= 0.5
    second, fresh = rank0(private)
    try:
        assert fresh != path and filestore.find(str(private), time.monotonic() + 5) == fresh
        assert [d.name for d in private.glob("rendezvous-*")] == [fresh.split("/")[-2]]  # the stale one removed
    finally:
        second.kill()
        second.wait()
