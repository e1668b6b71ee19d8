"""`make tensorboard`'s own choices: the port on 127.0.0.1, the run it shows, the local
run directory, and the one-line refusals (the container side: tests/containers/)."""

from __future__ import annotations

import json
import socket

import pytest
from recorded_engine import RecordedEngine, recorded

from orchestrator import images
from orchestrator.errors import UsageError
from orchestrator.topology.model import load
from orchestrator.verbs import tensorboard

from orch_helpers import REPO

SMOKE = str(REPO / "configs/cpu-smoke.yaml")


def test_a_taken_port_is_refused_by_name_and_the_default_moves_on():
    with socket.socket() as s:
        s.bind((tensorboard.HOST, 0))
        taken = s.getsockname()[1]
        with pytest.raises(UsageError, match=rf"^PORT={taken}: taken on 127\.0\.0\.1; leave PORT unset"):
            tensorboard.choose_port(taken)
    chosen = tensorboard.choose_port(None)
    assert tensorboard.DEFAULT_PORT <= chosen < tensorboard.DEFAULT_PORT + tensorboard.PORTS_TRIED


@pytest.mark.parametrize("run", ["../x", "a b", "-x"])
def test_a_run_that_cannot_name_a_directory_is_one_line(run):
    with pytest.raises(UsageError, match=r"^RUN=.*: a run id is 1 to 64 letters"):
        tensorboard.check_run(run)


def test_every_run_by_default_and_one_run_when_asked(tmp_path):
    t = load(str(REPO / "configs/cpu-smoke.yaml"))
    assert tensorboard.check_run(None) == ""
    assert tensorboard.local_logdir(t, "", str(tmp_path)) == tmp_path / "cpu-smoke/metrics/tensorboard"
    assert tensorboard.local_logdir(t, "r1", str(tmp_path)) == tmp_path / "cpu-smoke/metrics/tensorboard/r1"


def test_local_without_event_files_and_a_stack_are_refused_in_one_line(tmp_path, cli):
    t = load(str(REPO / "configs/cpu-smoke.yaml"))
    with pytest.raises(UsageError, match=r"no event files yet; `make local"):
        tensorboard.run_local(t, None, None, runs_dir=str(tmp_path))
    status, out, err = cli("stack-tensorboard")
    assert status == 2 and err.startswith("error: stack-tensorboard: not done for a swarm stack") and not out


# --- before anything starts: the image, the run ------------------------------------


def start_record(run_id: str) -> str:
    return json.dumps({"time": 1, "role": "ps", "rank": 0, "event": "start", "step": 0, "run_id": run_id})


@pytest.fixture
def engine(monkeypatch):
    """The engine `make tensorboard` asks: recorded containers, the cpu-smoke image, two runs."""
    found = RecordedEngine(
        recorded("status-workers3.json"),
        {"ps.jsonl": [start_record("20261123-140211-aaaaaa"), start_record("20261124-090000-bbbbbb")]},
        images=("ps-compose-cpu-smoke:latest",),
    )
    monkeypatch.setattr(images, "client", lambda timeout=600: found)
    return found


def test_before_the_image_exists_it_says_to_run_up_or_build_first(cli, engine):
    engine.tags.clear()
    status, out, err = cli("tensorboard", "-c", SMOKE)
    assert status == 2 and not out
    assert err == (
        "error: tensorboard: image ps-compose-cpu-smoke:latest of project cpu-smoke is not built yet; "
        "run make up (or make build) first\n"
    )


def test_a_run_that_is_not_there_is_refused_listing_the_runs(cli, engine):
    status, out, err = cli("tensorboard", "-c", SMOKE, "--run", "nosuchrun")
    assert status == 2 and not out
    assert err == (
        "error: RUN=nosuchrun: no such run in project cpu-smoke; "
        "its runs: 20261123-140211-aaaaaa, 20261124-090000-bbbbbb\n"
    )
    engine.metrics.clear()
    status, _, err = cli("tensorboard", "-c", SMOKE, "--run", "nosuchrun")
    assert status == 2 and "it has no run yet (make up starts one)" in err


def test_with_no_run_yet_it_starts_and_says_the_page_fills_once_up_trains(cli, engine, monkeypatch):
    from orchestrator.backends.compose import backend

    engine.metrics.clear()
    started = []
    monkeypatch.setattr(backend.ComposeBackend, "serve_board", lambda self, c, env: started.append(env) or "")
    monkeypatch.setattr(tensorboard, "wait_until_answers", lambda port, **kw: True)
    status, out, err = cli("tensorboard", "-c", SMOKE)
    assert status == 0, err
    assert started and started[0]["PSC_TENSORBOARD_RUN"] == ""
    assert "no run has written its curves yet: make up starts one" in out.splitlines()[-1]
