"""A mistake in a compose run is said once, not retried in a loop: cpu-smoke with a loss its
model's outputs do not fit (`mse` against class indices) stops the PS on its first held-out
batch with one line; compose restarts the container once (`restart: on-failure`), the restart
says the line again with `not retried` and exits 0, and no worker trains; `up` says the line
(exit status 2), not compose's "dependency failed to start"."""

from __future__ import annotations

import io
import time
import uuid

import pytest
import yaml

from orchestrator.backends.compose import adapter
from orchestrator.backends.registry import get
from orchestrator.errors import UsageError
from orchestrator.paths import ROOT
from orchestrator.verbs import cluster as verbs

pytestmark = [pytest.mark.slow, pytest.mark.docker]
LINE = "app: error: --loss mse: on a held-out batch (outputs [32, 10], targets [32])"


def test_a_plug_in_mistake_stops_the_ps_once_and_compose_does_not_loop(engine, offline_image, tmp_path):
    project = f"psc-mistake-{uuid.uuid4().hex[:6]}"
    doc = yaml.safe_load((ROOT / "configs/cpu-smoke.yaml").read_text())
    doc["image"]["tag"] = offline_image
    doc["train"]["loss"] = "mse"
    config = tmp_path / "topo.yaml"
    config.write_text(yaml.safe_dump(doc))
    started = time.monotonic()
    try:
        with pytest.raises(UsageError) as refused:
            verbs.up(get("compose"), str(config), name=project, remember=False, out=io.StringIO())
        time.sleep(5)  # what a loop would show: more restarts
        ps = next(c for c in adapter.containers(engine, project) if adapter.service_of(c) == "ps")
        ps.reload()
        log = adapter.log_text(engine, project, "ps")
        workers = [adapter.log_text(engine, project, f"worker{r}") for r in (1, 2)]
    finally:
        verbs.down(get("compose"), str(config), volumes=True, name=project, out=io.StringIO())
    said = [line for line in log.splitlines() if line.startswith("app: error:")]
    assert len(said) == 2 and said[0].startswith(LINE), log[-3000:]
    assert said[1].startswith(said[0]) and "(not retried: this container stopped on it" in said[1], said
    assert ps.attrs["State"]["Status"] == "exited" and ps.attrs["State"]["ExitCode"] == 0, ps.attrs["State"]
    assert ps.attrs["RestartCount"] == 1
    assert not any("Epoch:" in w for w in workers), workers
    assert time.monotonic() - started < 120
    assert str(refused.value).startswith(
        "ps stopped on a mistake and is not retried: --loss mse: on a held-out batch (outputs [32, 10], targets [32])"
    ), refused.value
