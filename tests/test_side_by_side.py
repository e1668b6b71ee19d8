"""`make test` runs the suite on pytest-xdist workers: the tests marked `docker` one after the
other on a single worker (the group `engine`, tests/conftest.py), the others beside them.
Shown on a small suite run the way `make test` runs it, with this conftest: a version of
pytest or xdist that lets the grouping lapse fails here, not as two clusters on one engine."""

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

@pytest.mark.parametrize("i", range(8))
def test_processes(i):
    time.sleep(0.3)
    ran(f"processes{i}")
"""


def run_suite(tmp_path: Path, suite: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text((HERE / "conftest.py").read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    docker: needs a Docker engine\n", encoding="utf-8")
    (tmp_path / "test_suite.py").write_text(suite, encoding="utf-8")
    (tmp_path / "ran").mkdir()
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-q", "-rf"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_engine_tests_run_on_one_worker_and_the_others_beside_them(tmp_path: Path) -> None:
    r = run_suite(tmp_path, SUITE)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = dict(p.name.split() for p in (tmp_path / "ran").iterdir())
    assert len(ran) == 12 and all(re.fullmatch(r"gw\d+", w) for w in ran.values()), ran
    engine = {worker for what, worker in ran.items() if what.startswith("cluster")}
    assert len(engine) == 1, f"the docker tests ran on {sorted(engine)}:\n{r.stdout}"
    others = {worker for what, worker in ran.items() if what.startswith("processes")}
    assert others - engine, f"no other test ran beside the docker ones:\n{r.stdout}"


def test_a_docker_test_in_a_group_of_its_own_stops_the_collection(tmp_path: Path) -> None:
    suite = "import pytest\n\n@pytest.mark.docker\n@pytest.mark.xdist_group('mine')\ndef test_x():\n    pass\n"
    r = run_suite(tmp_path, suite)
    assert r.returncode == 1
    assert "marked docker, so in the group engine; not also mine" in r.stdout, r.stdout + r.stderr
