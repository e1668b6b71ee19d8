"""`ps-compose runs sync` (orchestrator/verbs/mlflow_sync.py): a real `local` run whose MLflow
server is down across its end keeps what the server did not take; once a real server answers
there, the sync makes the MLflow run whole (FINISHED, every evaluation point, the model) and
removes what was kept."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import mlflow_testkit
import pytest

from orch_helpers import REPO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _orchestrator(here: Path, env: dict, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], cwd=here, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_a_server_down_across_the_runs_end_gets_the_whole_run_from_runs_sync(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    here = tmp_path / "here"
    here.mkdir()
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"  # nothing listens there while the run trains and ends
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "kept"}
    p = _orchestrator(here, env, "local", "-c", str(REPO / "configs/cpu-smoke.yaml"), "train.epochs=2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    metrics = here / "runs" / "cpu-smoke" / "metrics"
    (kept,) = (metrics / "mlflow-pending").iterdir()
    records = [json.loads(line) for line in (kept / "records.jsonl").read_text().splitlines()]
    ps = [json.loads(line) for line in (metrics / "ps.jsonl").read_text().splitlines()]
    evals = [r for r in ps if r["event"] in ("eval", "end")]
    kinds = [r["kind"] for r in records]  # all of it, in order: the server never answered
    assert kinds[:2] == ["start", "params"] and kinds[-1] == "close" and kinds.count("model") == 2 and "end" in kinds
    assert "runs sync" in p.stdout and f"kept in runs/cpu-smoke/metrics/mlflow-pending/{kept.name}" in p.stdout

    with mlflow_testkit.serve(tmp_path / "mlflow", "127.0.0.1", port):
        synced = _orchestrator(here, env, "runs", "sync", "cpu-smoke")
        assert synced.returncode == 0, synced.stdout + synced.stderr
        sent = [line for line in synced.stdout.splitlines() if line.startswith(f"runs sync: run {kept.name}: ")]
        assert len(sent) == 1 and sent[0].startswith(f"runs sync: run {kept.name}: sent to MLflow at {uri}: "), (
            synced.stdout
        )
        assert "ended FINISHED" in synced.stdout
        assert not kept.exists()
        client = MlflowClient(uri)
        (run,) = client.search_runs([client.get_experiment_by_name("kept").experiment_id])
        assert run.info.status == "FINISHED" and run.data.tags["ps-compose.run_id"] == kept.name
        curve = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "accuracy"))
        assert curve == sorted((r["step"], r["accuracy"]) for r in evals)
        assert run.data.params["train.epochs"] == "2"
        model = sorted(f.path for f in client.list_artifacts(run.info.run_id, "model"))
        assert "model/MLmodel" in model
        again = _orchestrator(here, env, "runs", "sync")
        assert again.returncode == 0 and "nothing kept" in again.stdout


def test_a_sync_of_a_name_with_no_run_is_one_line_and_exit_2(tmp_path: Path) -> None:
    p = _orchestrator(tmp_path, dict(os.environ), "runs", "sync", "nope")
    assert p.returncode == 2 and p.stderr.strip().endswith("no run of that name here (runs/nope does not exist)")
    assert len(p.stderr.splitlines()) == 1


def test_a_kept_record_naming_a_file_outside_the_kept_directory_is_refused(tmp_path: Path) -> None:
    """What a kept record names is the job's word, read on the host: a path out of the kept
    files (a container's PS could write one into its state volume) is never read or sent."""
    from orchestrator.verbs.mlflow_sync import _kept_file

    files = tmp_path / "kept" / "files"
    (files / "model").mkdir(parents=True)
    (files / "model" / "MLmodel").write_text("flavors: {}")
    (tmp_path / "secret").write_text("the host's")
    (files / "model" / "link").symlink_to(tmp_path / "secret")
    assert _kept_file(files, "model/MLmodel").read_text() == "flavors: {}"
    for outside in ("../../secret", "model/link", "/etc/passwd", "model/missing"):
        with pytest.raises(ValueError, match="not a file of"):
            _kept_file(files, outside)
