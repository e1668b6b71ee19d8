"""The local target's blocks (orchestrator/backends/local/backend.py): a run started by `deploy`
is a real launcher (`python -m orchestrator local`) with real processes, here of a stand-in
`app` package, and every other block reads it from outside, as a later command would."""

from __future__ import annotations

import io
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from orchestrator import runs
from orchestrator.backends.base import Cluster, LogOptions, ServiceState
from orchestrator.backends.registry import LOCAL, RUNNING
from orchestrator.backends.target_run import wait_until
from orchestrator.errors import UsageError
from orchestrator.metrics.records import parse_lines
from orchestrator.topology.model import load

from orch_helpers import topology

pytestmark = pytest.mark.slow  # real launchers and processes

# Each process says hello, writes a record, and runs until the test's file `end` exists.
FAKE_APP = """
import json, os, sys, time
name = "ps" if sys.argv[1] == "ps" else "worker" + os.environ["PSC_RANK"]
print(f"{name} says hello", flush=True)
with open(os.path.join(os.environ["PSC_METRICS_DIR"], name + ".jsonl"), "a") as f:
    f.write(json.dumps({"event": "join", "time": time.time(), "worker": name}) + "\\n")
while not os.path.exists("end"):
    time.sleep(0.05)
"""


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A cluster of the local target in tmp_path (a stand-in `app` there), its document written."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "__main__.py").write_text(FAKE_APP)
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topology()))
    monkeypatch.chdir(tmp_path)
    t = load(tmp_path / "topo.yaml")
    c = Cluster(t.name, tmp_path / "runs" / t.name / LOCAL.output, topology=t)
    c.file.parent.mkdir(parents=True)
    c.file.write_text(LOCAL.render(t, str(tmp_path)))
    yield c
    (tmp_path / "end").touch()
    if LOCAL.describe(c) and any(not s.ended for s in LOCAL.describe(c)):
        LOCAL.remove(c, volumes=False)


def _states(c: Cluster) -> dict[str, ServiceState]:
    return {s.service: s for s in LOCAL.describe(c)}


def test_local_is_a_running_target_whose_document_is_its_topology(run: Cluster) -> None:
    assert RUNNING["local"] is LOCAL and set(RUNNING) == {"local", "compose", "swarm"}
    assert load(run.file) == run.topology


def test_a_deployed_run_is_read_struck_and_stopped_through_the_blocks(run: Cluster) -> None:
    run_id = runs.new_id()
    LOCAL.deploy(run, runs.environment(run_id, False), io.StringIO())

    states = _states(run)
    assert set(states) == {"ps", "worker1", "worker2"} and all(s.running for s in states.values()), states
    assert LOCAL.running_env(run, runs.VARIABLES) == {runs.RUN_ID: run_id}
    for private in ("local.log", "local-state.json"):  # the account's own, as the run's secret
        assert (run.file.parent / private).stat().st_mode & 0o077 == 0, private
    records = wait_until("every record", lambda: (f := LOCAL.read_records(run, "ps")) and len(f) == 3 and f, 30)
    assert [r["worker"] for r in parse_lines(records["worker2.jsonl"])] == ["worker2"]

    # SIGKILL a worker's app: the launcher starts it again, as compose's restart: on-failure.
    LOCAL.signal_app(run, "worker2", "SIGKILL")
    again = wait_until(
        "worker2 started again", lambda: (s := _states(run)["worker2"]).restarts == 1 and s.running and s, 30
    )
    assert again.exit_code == -signal.SIGKILL
    wait_until("its second record", lambda: len(parse_lines(LOCAL.read_records(run, "ps")["worker2.jsonl"])) == 2, 30)

    logs = LOCAL.log_iter(run, follow=False)
    text = "".join(logs)
    assert "worker2 | exited with code -9; restarting (1 of 3)" in text, text
    assert text.count("worker2 | worker2 says hello") == 2 and "ps      | ps says hello" in text, text
    following = LOCAL.log_iter(run, follow=True)  # follows while the run lives: ends once it has
    LOCAL.remove(run, volumes=True)
    assert "stopped (code" in "".join(following)

    assert all(s.ended for s in LOCAL.describe(run)) and LOCAL.running_env(run, runs.VARIABLES) == {}
    assert not (run.file.parent / "metrics").exists() and not (run.file.parent / "checkpoints").exists()


def test_a_second_deploy_of_a_live_name_is_refused_with_the_launchers_line(run: Cluster) -> None:
    LOCAL.deploy(run, runs.environment(runs.new_id(), False), io.StringIO())
    live = _states(run)
    with pytest.raises(UsageError, match=r"did not start \(exit status 2\): .*live"):
        LOCAL.deploy(run, runs.environment(runs.new_id(), False), io.StringIO())
    assert _states(run) == live  # the live run is untouched


def test_a_run_whose_launcher_was_killed_is_dead_not_running(run: Cluster) -> None:
    LOCAL.deploy(run, runs.environment(runs.new_id(), False), io.StringIO())
    launcher = yaml.safe_load((run.file.parent / "local-state.json").read_text())["launcher"]
    os.kill(launcher, signal.SIGKILL)
    # Its processes get SIGTERM as it dies (PR_SET_PDEATHSIG) and the run's lock goes with the last.
    wait_until("the run's lock free", lambda: LOCAL.running_env(run, runs.VARIABLES) == {}, 30)
    assert {s.status for s in LOCAL.describe(run)} == {"dead"}
    with pytest.raises(UsageError, match="no live process of service 'worker1'"):
        LOCAL.signal_app(run, "worker1", "SIGKILL")


def test_the_blocks_the_local_target_cannot_give_are_refused_in_one_line(run: Cluster) -> None:
    LOCAL.deploy(run, runs.environment(runs.new_id(), False), io.StringIO())
    with pytest.raises(UsageError, match="no times"):
        LOCAL.log_iter(run, follow=False, options=LogOptions(since="1m"))
