"""`up` runs in containers never inherit another run's state by accident: an unfinished run
stopped with `down`; `up --resume` continues its checkpoint and says which version; a plain
`up` after that starts at version 0, says so and moves the old files aside in the volume."""

from __future__ import annotations

import io
import json
import re
import shutil
import time
import uuid

import pytest
import torch
import yaml

from app.training.models import SmallCNN
from orchestrator.backends import command
from orchestrator.backends.compose import adapter
from orchestrator.backends.registry import get
from orchestrator.paths import ROOT, RUNS
from orchestrator.verbs import cluster as verbs
from orchestrator.verbs import export as export_verb

pytestmark = [pytest.mark.slow, pytest.mark.docker]
TIMEOUT = 120


def _ps_log_until(engine, project: str, pattern: str) -> re.Match:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        found = re.search(pattern, adapter.log_text(engine, project, "ps"), re.M)
        if found:
            return found
        time.sleep(1)
    pytest.fail(f"the PS never logged {pattern!r}:\n{adapter.log_text(engine, project, 'ps')[-3000:]}")


def test_up_starts_fresh_after_an_unfinished_run_and_resume_continues_it(engine, offline_image, tmp_path):
    project = f"psc-runs-{uuid.uuid4().hex[:8]}"
    doc = yaml.safe_load((ROOT / "configs/cpu-smoke.yaml").read_text())
    doc["name"], doc["image"]["tag"] = project, offline_image
    doc["train"]["epochs"] = 500  # never finishes within the test: every run is stopped mid-way
    doc["ps"]["checkpoint_every"] = 20
    doc["workers"]["count"] = 1
    config = tmp_path / "runs.yaml"
    config.write_text(yaml.safe_dump(doc))

    def up(*, resume: bool) -> str:
        out = io.StringIO()
        assert verbs.up(get("compose"), str(config), name=project, remember=False, out=out, resume=resume) == 0
        return out.getvalue()

    def down() -> None:
        assert verbs.down(get("compose"), str(config), name=project) == 0

    try:
        said = up(resume=False)
        run_a = re.search(r"^==> run (\S+): starts fresh at version 0", said, re.M).group(1)
        _ps_log_until(engine, project, r"checkpoint ckpt-\d+-\w+\.pt \(every 20 updates")
        down()  # SIGTERM: the PS checkpoints on the way out; run A is unfinished
        said = io.StringIO()  # its model is exported from its newest checkpoint, and says so
        assert export_verb.export(get("compose"), str(config), name=project, out=said) == 0
        card = json.loads((RUNS / project / "model" / "model.json").read_text())
        assert card["run_id"] == run_a and card["finished"] is False and card["version"] > 0
        assert "its newest checkpoint (the run did not finish)" in said.getvalue()
        weights = torch.load(RUNS / project / "model" / "model.pt", weights_only=True)
        SmallCNN(**card["kwargs"]).load_state_dict(weights, strict=True)

        said = up(resume=True)
        run_b = re.search(
            r"^==> run (\S+): --resume: the PS continues the newest unfinished checkpoint", said, re.M
        ).group(1)
        resumed = _ps_log_until(
            engine,
            project,
            rf"resumed from \S+: version (\d+) \(run {run_a}, "
            r"continued by --resume\)",
        )
        assert int(resumed.group(1)) >= 20
        down()

        run_c = re.search(r"^==> run (\S+): starts fresh", up(resume=False), re.M).group(1)
        fresh = _ps_log_until(
            engine,
            project,
            r"not resuming from ckpt-\S+ \(version (\d+)\): it is of run (\S+), "
            r"this is run \S+ .*; starting a new run at version 0; its files "
            r"moved to /state/checkpoints/previous/(\S+)$",
        )
        # The newest checkpoint is run A's, or run B's if B trained before its `down`.
        assert int(fresh.group(1)) >= int(resumed.group(1)) and fresh.group(2) in (run_a, run_b)
        assert fresh.group(3) == fresh.group(2) and len({run_a, run_b, run_c}) == 3
    finally:
        command.run(
            adapter.down_argv(
                adapter.detect(),
                adapter.Project(project, str(get("compose").path_of(project)), str(ROOT)),
                volumes=True,
            ),
            capture=True,
            check=False,
        )
        shutil.rmtree(RUNS / project, ignore_errors=True)
