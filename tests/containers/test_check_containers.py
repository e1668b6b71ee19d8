"""The connectivity check in real containers: cpu-smoke with 2 workers on its own
compose project, the image built from the current app code (fixture `offline_image`)."""

import io
import os
import re

import pytest

from orchestrator.backends.compose import adapter as compose_adapter
from orchestrator.paths import ROOT
from orchestrator.topology.model import load
from orchestrator.verbs import check as check_verb

# In the engine group beside `engine` (tests/conftest.py): its projects are its own.
pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.xdist_group("engine-2")]

CONFIG = os.path.join(ROOT, "configs", "cpu-smoke.yaml")
PROJECT = "psc-test-check"
ROW = re.compile(
    r"^check: (\S+)\s+rank (\d)\s+host (\S+) (\d+\.\d+\.\d+\.\d+): 4 B ([0-9.]+) ms, "
    r"8 MiB ([0-9.]+) ms, ([0-9.]+) GB/s$",
    re.MULTILINE,
)


def _left(engine) -> list:
    return engine.containers.list(all=True, filters={"label": f"{compose_adapter.LABEL_PROJECT}={PROJECT}"})


def test_check_passes_and_reports_every_rank(engine, offline_image):
    out = io.StringIO()
    code = check_verb.run_containers(load(CONFIG).with_workers(2), timeout=30, project=PROJECT, out=out)
    text = out.getvalue()
    assert code == 0, text
    rows = ROW.findall(text)
    assert [(name, int(rank)) for name, rank, *_ in rows] == [("worker1", 1), ("worker2", 2)], text
    assert len({row[3] for row in rows}) == 2  # two containers, two addresses
    assert re.search(r"^check: ps \(rank 0\) on \S+ \d+\.\d+\.\d+\.\d+ waits for 2 ranks at ps:29500", text, re.M), text
    assert "==> check passed: ps, worker1, worker2 (containers, project psc-test-check" in text
    assert _left(engine) == []


def test_check_with_a_rank_missing_fails_naming_it(engine, offline_image):
    out = io.StringIO()
    code = check_verb.run_containers(
        load(CONFIG).with_workers(2), timeout=5, without=["worker2"], project=PROJECT, out=out
    )
    text = out.getvalue()
    assert code == 1, text
    assert "check failed: worker2 (rank 2) did not reach ps:29500 within 5 s" in text
    assert re.search(r"^==> check FAILED: worker2 \(containers", text, re.M), text
    assert _left(engine) == []
