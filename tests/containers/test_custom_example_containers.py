"""Your own model and dataset in real containers: examples/custom/topology.yaml (a
tiny CNN on digits.npz, both from the read-only `code` mount) with `up`, PS + 2
workers; the PS exits 0 with its `Accuracy:` line, and `export` writes its model. Own
project name, torn down before and after."""

import io
import json
import os

import pytest

from orchestrator import images, paths
from orchestrator.backends.compose import adapter as compose_adapter
from orchestrator.backends.registry import get
from orchestrator.metrics import records
from orchestrator.paths import ROOT
from orchestrator.topology.model import load
from orchestrator.topology.services import PIDNS_SERVICE
from orchestrator.verbs import cluster as verbs
from orchestrator.verbs import export as export_verb

pytestmark = [pytest.mark.slow, pytest.mark.docker]

CONFIG = os.path.join(ROOT, "examples", "custom", "topology.yaml")
PROJECT = "psc-test-custom"
# PS + 2 workers as processes on a 2-core CPU VM: 0.928-0.953 (tests/app/training/test_plugins.py).
THRESHOLD = 0.85


def test_the_custom_example_trains_in_containers(engine, offline_image, tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RUNS", tmp_path)  # nothing of the user's runs/ is touched
    t = load(CONFIG)
    # Its own tag: built now (cached layers of offline_image), so `up` never runs an older app.
    images.build(t.image_tag, *images.source(t, offline=True))
    verbs.down(get("compose"), CONFIG, 2, volumes=True, name=PROJECT)
    try:
        out = io.StringIO()
        assert verbs.up(get("compose"), CONFIG, 2, name=PROJECT, remember=False, out=out) == 0, out.getvalue()
        # the PS, 2 workers and the holder of their PID namespace (network.same_host_copy)
        states = compose_adapter.wait_exited(engine, PROJECT, 4, timeout=300, out=io.StringIO())
        logs = io.StringIO()
        compose_adapter.print_logs(engine, PROJECT, logs)
        assert states is not None, f"not every container exited within 300 s\n{logs.getvalue()[-6000:]}"
        codes = {s.service: (s.exit_code, s.restarts) for s in states}
        expected = {"ps": (0, 0), "worker1": (0, 0), "worker2": (0, 0), PIDNS_SERVICE: (0, 0)}
        assert codes == expected, logs.getvalue()[-6000:]
        ps_log = compose_adapter.log_text(engine, PROJECT, "ps")
        files = compose_adapter.read_metrics(engine, PROJECT, compose_adapter.containers(engine, PROJECT))
        accuracy = records.final_accuracy(records.parse_lines(files.get("ps.jsonl", [])))
        assert accuracy is not None and accuracy >= THRESHOLD, ps_log[-3000:]
        assert "held-out split: 359 samples, 1 channel(s), 10 classes" in ps_log, ps_log[-3000:]

        # the export container mounts the same `code` dir, a relative bind source (before: the
        # SDK's "includes invalid characters for a local volume name", exit 1)
        said = io.StringIO()
        assert export_verb.export(get("compose"), CONFIG, name=PROJECT, out=said) == 0, said.getvalue()
        model = tmp_path / PROJECT / "model"
        card = json.loads((model / "model.json").read_text())
        assert card["accuracy"] == pytest.approx(accuracy) and (model / "model.pt").stat().st_size > 0
    finally:
        verbs.down(get("compose"), CONFIG, 2, volumes=True, name=PROJECT)
