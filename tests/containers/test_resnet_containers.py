"""`make up CONFIG=configs/cpu-resnet.yaml WORKERS=2` in real containers: torchvision's
ResNet-18 on an Imagenette-layout tree (what `make sample-data` writes), to the
accuracy the processes reach, every container exiting 0."""

from __future__ import annotations

import io
import re

import pytest
import yaml

from orchestrator import paths, sample_data
from orchestrator.backends.compose import adapter as compose_adapter
from orchestrator.backends.registry import get
from orchestrator.paths import ROOT
from orchestrator.verbs import cluster as verbs

from ps_log import last_evaluations

pytestmark = [pytest.mark.slow, pytest.mark.docker]

CONFIG = ROOT / "configs" / "cpu-resnet.yaml"
# The mean of the PS's last two evaluations, as tests/app/training/test_resnet.py (whose
# comment gives the measured spread; the same config and seed in containers, where one
# run on a 2-core CPU VM read 0.755 0.780 (0.77)).
THRESHOLD = 0.60


def test_cpu_resnet_trains_in_containers(engine, tmp_path, monkeypatch):
    tree = tmp_path / "sample-imagenette"
    sample_data.write_tree(tree, size=32)
    topology = yaml.safe_load(CONFIG.read_text())
    topology["train"]["data_dir"] = str(tree)
    config = tmp_path / "cpu-resnet.yaml"
    config.write_text(yaml.safe_dump(topology))
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    project = "psc-test-resnet"
    verbs.down(get("compose"), str(config), 2, volumes=True, name=project)
    try:
        out = io.StringIO()
        # The image is built on first use, as `make up` does (FROM the offline base).
        assert verbs.up(get("compose"), str(config), 2, name=project, remember=False, out=out, offline=True) == 0, (
            out.getvalue()
        )
        # the PS, 2 workers and the holder of their PID namespace (network.same_host_copy)
        states = compose_adapter.wait_exited(engine, project, 4, timeout=900, out=io.StringIO())
        assert states is not None, "the cluster did not finish within 900 s"
        containers = engine.containers.list(all=True, filters={"label": f"{compose_adapter.LABEL_PROJECT}={project}"})
        logs = {c.labels[compose_adapter.LABEL_SERVICE]: c.logs().decode() for c in containers}
        exits = {c.labels[compose_adapter.LABEL_SERVICE]: c.attrs["State"]["ExitCode"] for c in containers}
        assert exits == {"ps": 0, "worker1": 0, "worker2": 0, "pidns": 0}, logs.get("ps", "")[-3000:]
        assert "model resnet18: 11181642 parameters" in logs["ps"]
        assert re.search(r"^worker1 \| Epoch: 6 \| Batch: \d+ \| Loss: ", logs["worker1"], re.MULTILINE)
        final = float(re.search(r"^Accuracy: ([0-9.]+)$", logs["ps"], re.MULTILINE).group(1))
        last = last_evaluations(logs["ps"], 2)
        print(f"cpu-resnet in containers: last two evaluations {last}, final {final:.4f}")
        assert len(last) == 2 and last[-1] == final, logs["ps"][-3000:]
        assert sum(last) / 2 >= THRESHOLD, logs["ps"][-3000:]
    finally:
        verbs.down(get("compose"), str(config), 2, volumes=True, name=project)
