"""`make test` runs the suite on pytest-xdist workers: the tests marked `docker` one after the
other within their engine group (`engine`, or one they name, tests/conftest.py), each group
on one worker, the others beside them. Shown on a small suite run the way `make test` runs
it, with this conftest: a version of pytest or xdist that lets the grouping lapse fails
here, not as clusters piling up on one engine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SUITE = """
import os, pathlib, time
import pytest

def ran(what):
    pathlib.Path("ran", f"{what} {os.environ.get('PYTEST_XDIST_WORKER')}").touch()

@pytest.mark.docker
@pytest.mark.parametrize("i", range(4))
def test_cluster(i):
    time.sleep(0.5)
    ran(f"cluster{i}")

@pytest.mark.docker
@pytest.mark.xdist_group("engine-2")
@pytest.mark.parametrize("i", range(3))
def test_second(i):
    time.sleep(0.5)
    ran(f"second{i}")

@pytest.mark.parametrize("i", range(8))
def test_processes(i):
    time.sleep(0.3)
    ran(f"processes{i}")
"""


def run_suite(tmp_path: Path, suite: str) -> subprocess.CompletedProcess:
    for kit in ("conftest.py", "engine_networks.py"):  # the grouping, and the holds it takes
        (tmp_path / kit).write_text((HERE / kit).read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    docker: needs a Docker engine\n", encoding="utf-8")
    (tmp_path / "test_suite.py").write_text(suite, encoding="utf-8")
    (tmp_path / "ran").mkdir()
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "3", "--dist", "loadgroup", "-p", "no:cacheprovider", "-q", "-rf"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_each_engine_group_runs_on_one_worker_and_the_others_beside_them(tmp_path: Path) -> None:
    r = run_suite(tmp_path, SUITE)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = dict(p.name.split() for p in (tmp_path / "ran").iterdir())
    assert len(ran) == 15 and all(re.fullmatch(r"gw\d+", w) for w in ran.values()), ran

    def workers(kind: str) -> set[str]:
        return {worker for what, worker in ran.items() if what.startswith(kind)}

    assert len(workers("cluster")) == 1, f"the tests of the group engine ran on {sorted(workers('cluster'))}"
    assert len(workers("second")) == 1, f"the tests of the group engine-2 ran on {sorted(workers('second'))}"
    assert workers("cluster") != workers("second"), "the two engine groups ran on one worker, one after the other"
    assert workers("processes") - workers("cluster") - workers("second"), f"no other test ran beside them: {ran}"


def test_a_docker_test_in_a_group_that_is_no_engine_group_fails(tmp_path: Path) -> None:
    suite = "import pytest\n\n@pytest.mark.docker\n@pytest.mark.xdist_group('mine')\ndef test_x():\n    pass\n"
    r = run_suite(tmp_path, suite)
    assert r.returncode == 1
    assert "marked docker, so in an engine group; not in mine" in r.stdout, r.stdout + r.stderr
