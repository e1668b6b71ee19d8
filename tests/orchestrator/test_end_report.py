"""The report at the end of every run (orchestrator/metrics/end_report.py): a real `local` run
ends with its PNGs in runs/<name>/report/ and a line naming them; tracked in a real MLflow
server, the same PNGs are its MLflow run's `report/` beside the workers' loss curves."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import mlflow_testkit
import pytest

from orchestrator.errors import UsageError
from orchestrator.metrics import end_report, report

from orch_helpers import REPO

PNGS = ["accuracy.png", "loss.png", "staleness.png", "throughput.png"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_tracked_local_run_ends_with_its_report_and_logs_its_pngs_to_its_mlflow_run(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    here = tmp_path / "here"
    here.mkdir()
    with mlflow_testkit.serve(tmp_path / "mlflow", "127.0.0.1", _free_port()) as uri:
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "ended"}
        argv = ["local", "-c", str(REPO / "configs/cpu-smoke.yaml"), "--workers", "2", "train.epochs=2"]
        p = subprocess.run(
            [sys.executable, "-m", "orchestrator", *argv],
            cwd=here,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        target = here / "runs" / "cpu-smoke" / "report"
        assert sorted(f.name for f in target.iterdir()) == sorted([*PNGS, "summary.txt"])
        *_, drawn, logged = p.stdout.splitlines()
        assert drawn == f"local: report: {', '.join(report.PLOTS)}, summary.txt in runs/cpu-smoke/report/"
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name("ended")
        (run,) = client.search_runs([experiment.experiment_id])
        run_id = run.data.tags["ps-compose.run_id"]
        assert logged == f"local: report logged to MLflow run {run_id} as report/ (4 PNGs)"
        names = sorted(f.path for f in client.list_artifacts(run.info.run_id, "report"))
        assert names == [f"report/{name}" for name in PNGS]
        copy = client.download_artifacts(run.info.run_id, "report/loss.png", str(tmp_path))
        assert Path(copy).read_bytes() == (target / "loss.png").read_bytes()
        assert client.get_metric_history(run.info.run_id, "worker1/loss")  # the workers' curves beside it
        assert client.get_metric_history(run.info.run_id, "worker2/loss")


@pytest.mark.slow
def test_a_run_not_in_the_tracking_servers_experiment_is_one_line_and_nothing_sent(tmp_path: Path) -> None:
    with mlflow_testkit.serve(tmp_path / "mlflow", "127.0.0.1", _free_port()) as uri:
        said = end_report.log_to_mlflow(uri, "no-such-experiment", "r-1", [], {})
    assert said == f"report not logged to MLflow at {uri}: no run r-1 in experiment no-such-experiment"


def test_a_server_that_does_not_answer_is_one_line_without_its_password() -> None:
    uri = f"http://someone:s3cret@127.0.0.1:{_free_port()}"  # nothing listens there
    said = end_report.log_to_mlflow(uri, "e", "r-1", [], {})
    assert said.startswith("report not logged to MLflow at http://***@127.0.0.1:") and "s3cret" not in said


def test_without_matplotlib_the_report_says_what_to_install_in_one_line(monkeypatch, tmp_path: Path) -> None:
    real = report.importlib.util.find_spec
    monkeypatch.setattr(
        report.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    with pytest.raises(UsageError, match=r"pip install 'ps-compose\[report\]'"):
        report.require_matplotlib()
    out = io.StringIO()
    assert end_report.after_run(tmp_path, out, "local:") is None
    assert out.getvalue() == (
        "local: no report drawn: the report's plots need matplotlib, which is not installed here: "
        "pip install 'ps-compose[report]'\n"
    )
