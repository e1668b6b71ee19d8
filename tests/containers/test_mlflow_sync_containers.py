"""`ps-compose runs sync` of a compose run (orchestrator/verbs/mlflow_sync.py): the PS in its
container never reaches its MLflow server, keeps what it did not send in the state volume, and
once a real server answers the sync makes the MLflow run whole and removes what was kept."""

from __future__ import annotations

import io
import shutil
import uuid

import mlflow_testkit
import pytest
import yaml

from orchestrator import images
from orchestrator.backends import command
from orchestrator.backends.base import Cluster
from orchestrator.backends.compose import adapter
from orchestrator.backends.registry import BACKENDS
from orchestrator.metrics.records import parse_lines
from orchestrator.paths import ROOT, RUNS
from orchestrator.topology.model import load
from orchestrator.verbs import cluster as verbs
from orchestrator.verbs import mlflow_sync

from app_testkit import free_port

# In the engine group beside `engine` (tests/conftest.py): its projects are its own.
pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.xdist_group("engine-2")]

TAG = "ps-compose-sync-test:latest"  # the cpu-smoke image of this tree


def test_a_compose_runs_kept_mlflow_records_reach_the_server_once_it_answers(engine, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    t = load(str(ROOT / "configs/cpu-smoke.yaml"))
    images.build(TAG, *images.source(t, offline=True))
    project = f"ks-{uuid.uuid4().hex[:8]}"
    doc = yaml.safe_load((ROOT / "configs/cpu-smoke.yaml").read_text())
    doc["name"], doc["image"]["tag"] = project, TAG
    doc["train"]["epochs"] = 2
    config = tmp_path / "ks.yaml"
    config.write_text(yaml.safe_dump(doc))
    port = free_port()
    # inside the PS's container 127.0.0.1 is the container itself: nothing answers there, ever
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "kept-in-volume")
    backend = BACKENDS["compose"]
    proj = adapter.Project(project, str(backend.path_of(project)), str(ROOT))
    try:
        assert verbs.up(backend, str(config), name=project, remember=False, out=io.StringIO()) == 0
        states = adapter.wait_exited(engine, project, 3, 600, io.StringIO())
        assert states and all(s.exit_code == 0 for s in states), states
        records = parse_lines(adapter.read_metrics(engine, project, adapter.containers(engine, project))["ps.jsonl"])
        [run_id] = {r["run_id"] for r in records if r["event"] == "start"}
        evals = [r for r in records if r["event"] in ("eval", "end")]
        c = Cluster(project, backend.path_of(project))
        assert backend.read_kept(c), "the PS kept nothing in the state volume"
        with mlflow_testkit.serve(tmp_path / "mlflow", "127.0.0.1", port) as uri:
            out = io.StringIO()
            assert mlflow_sync.sync(project, out=out) == 0, out.getvalue()
            said = out.getvalue()
            assert f"runs sync: run {run_id}: sent to MLflow at {uri}: " in said and "ended FINISHED" in said, said
            client = MlflowClient(uri)
            (run,) = client.search_runs([client.get_experiment_by_name("kept-in-volume").experiment_id])
            assert run.info.status == "FINISHED" and run.data.tags["ps-compose.run_id"] == run_id
            curve = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "accuracy"))
            assert curve == sorted((r["step"], r["accuracy"]) for r in evals)
            assert "model/MLmodel" in {f.path for f in client.list_artifacts(run.info.run_id, "model")}
            again = io.StringIO()
            assert mlflow_sync.sync(project, out=again) == 0 and "nothing kept" in again.getvalue(), again.getvalue()
    finally:
        command.run(adapter.down_argv(adapter.detect(), proj, volumes=True), capture=True, check=False)
        shutil.rmtree(RUNS / project, ignore_errors=True)
