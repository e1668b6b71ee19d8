"""Runs of one name in real containers: a second `up` of a project whose run is live is refused
in one line (UsageError: exit 2) and touches nothing; once that run has ended, `up` starts a new one. A
`scale` that comes as the run ends says so in one line and leaves no container behind in
state Created (compose used to fail raw: `dependency failed to start: container ...-ps-1
exited (0)`)."""

from __future__ import annotations

import io
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.backends.compose import adapter
from orchestrator.backends.compose.backend import ComposeBackend
from orchestrator.backends.registry import BACKENDS, get
from orchestrator.errors import UsageError
from orchestrator.paths import ROOT
from orchestrator.verbs import cluster as verbs
from orchestrator.verbs import live_names, scaling

pytestmark = [pytest.mark.slow, pytest.mark.docker]
TIMEOUT = 240.0


def _config(tmp_path: Path, image: str, **train: Any) -> Path:
    doc = yaml.safe_load((ROOT / "configs/cpu-smoke.yaml").read_text())
    doc["image"]["tag"] = image
    doc["train"].update(train)
    doc["workers"]["max"] = 4
    path = tmp_path / "names.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _states(engine, project: str) -> dict[str, str]:
    return {adapter.service_of(c): c.attrs["State"]["Status"] for c in adapter.containers(engine, project)}


def _ids(engine, project: str) -> dict[str, str]:
    return {adapter.service_of(c): c.id for c in adapter.containers(engine, project)}


def _runs_ended(engine, project: str) -> int:
    """How many times the PS's container logged its run's end (`Time: N seconds`)."""
    return len(re.findall(r"^Time: [0-9.]+ seconds$", adapter.log_text(engine, project, "ps"), re.M))


def _until(what: str, check, timeout: float = TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(1)
    pytest.fail(f"{what}: not within {timeout:.0f} s")


def _ended(engine, project: str) -> bool:
    states = _states(engine, project)
    return bool(states) and all(s == "exited" for s in states.values())


def test_a_second_up_of_a_live_project_is_refused_and_one_whose_run_ended_starts_anew(engine, offline_image, tmp_path):
    project = f"psc-names-{uuid.uuid4().hex[:6]}"
    config = _config(tmp_path, offline_image, epochs=6)
    compose = get("compose")
    try:
        out = io.StringIO()
        assert verbs.up(compose, str(config), name=project, remember=False, out=out) == 0, out.getvalue()
        first = _ids(engine, project)
        with pytest.raises(UsageError) as refused:
            verbs.up(compose, str(config), name=project, remember=False, out=io.StringIO())
        said = str(refused.value)
        assert "\n" not in said and said.startswith(f"up: project {project} has a live run "), said
        assert f"give this one another name (make up NAME={project}-2)" in said
        # the name is live on compose: every other target refuses it too, before anything starts there
        with pytest.raises(UsageError) as elsewhere:
            verbs.up(get("swarm"), str(config), name=project, remember=False, out=io.StringIO())
        said = str(elsewhere.value)
        assert said.startswith(f"stack-up: project {project} of target compose has a live run "), said
        assert said.endswith(f"or end that one first (make down NAME={project})"), said
        with pytest.raises(UsageError, match=rf"^local: project {project} of target compose has a live run "):
            live_names.refuse_elsewhere(project, live_names.LOCAL, "local", "--name x-2", BACKENDS.values())
        assert _ids(engine, project) == first  # nothing recreated, nothing added

        _until("the first run ended", lambda: _ended(engine, project))
        out = io.StringIO()
        assert verbs.up(compose, str(config), name=project, remember=False, out=out) == 0, out.getvalue()
        assert "starts fresh at version 0" in out.getvalue()
        _until("the second run ended", lambda: _ended(engine, project))
        assert _runs_ended(engine, project) == 1
    finally:
        verbs.down(compose, str(config), name=project, volumes=True, out=io.StringIO())


class LookedWhileItRan(ComposeBackend):
    """The compose target, but its first look at the cluster is one taken while the run went on:
    `scale` decides what to start while the PS runs, and compose acts once it has exited (the
    race of a `make scale` a moment before the end, made certain)."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def describe(self, c):
        if self.seen:
            earlier, self.seen = self.seen, []
            return earlier
        return super().describe(c)


def test_a_scale_as_the_run_ends_says_so_in_one_line_and_leaves_nothing_created(engine, offline_image, tmp_path):
    project = f"psc-names-{uuid.uuid4().hex[:6]}"
    config = _config(tmp_path, offline_image, epochs=3)
    compose = get("compose")
    try:
        assert verbs.up(compose, str(config), name=project, remember=False, out=io.StringIO()) == 0
        c = verbs.resolve(compose, str(config), None, name=project)
        running = _until(
            "the PS and both workers running",
            lambda: (lambda s: s if {"ps", "worker1", "worker2"} <= {x.service for x in s if x.running} else None)(
                compose.describe(c)
            ),
        )
        _until("the run ended", lambda: _ended(engine, project))

        with pytest.raises(UsageError) as refused:
            scaling.scale(LookedWhileItRan(list(running)), str(config), 4, name=project, out=io.StringIO())
        assert str(refused.value) == (
            f"scale: the run of project {project} has ended (its PS exited 0): nothing to scale; "
            "make status shows how it ended, make up starts a new run"
        )
        states = _states(engine, project)
        assert "created" not in states.values(), states
        assert not {s for s, v in states.items() if v in ("running", "restarting")} - {"worker3", "worker4"}
        _until("whatever the scale started exited", lambda: _ended(engine, project), timeout=120)
        assert _runs_ended(engine, project) == 1, "the ended PS was started again"
    finally:
        verbs.down(compose, str(config), name=project, volumes=True, out=io.StringIO())
