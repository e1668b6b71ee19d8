"""`make tensorboard`'s own choices: the port on 127.0.0.1, the run it shows, the local
run directory, and the one-line refusals (the container side: tests/containers/)."""

from __future__ import annotations

import socket

import pytest

from orchestrator import tensorboard
from orchestrator.errors import UsageError
from orchestrator.topology.model import load

from orch_helpers import REPO


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


def test_local_without_event_files_and_a_stack_are_refused_in_one_line(tmp_path):
    t = load(str(REPO / "configs/cpu-smoke.yaml"))
    with pytest.raises(UsageError, match=r"no event files yet; `make local"):
        tensorboard.run_local(t, None, None, runs_dir=str(tmp_path))
    with pytest.raises(UsageError, match=r"^stack-tensorboard: not done for a swarm stack"):
        tensorboard.refuse_swarm()
