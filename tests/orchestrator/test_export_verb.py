"""`python -m orchestrator export` (orchestrator/verbs/export.py): a run's model to
runs/<name>/model/, from make local's runs and (tests/containers) from a compose volume."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from orchestrator import paths
from orchestrator.backends import export_container
from orchestrator.errors import UsageError
from orchestrator.render import compose as render_compose
from orchestrator.topology.model import load

from orch_helpers import REPO

LOAD = """
import json, sys, torch
from app.training.models import SmallCNN
card = json.load(open(sys.argv[1] + "/model.json"))
model = SmallCNN(**card["kwargs"])
model.load_state_dict(torch.load(sys.argv[1] + "/model.pt", weights_only=True), strict=True)
print(card["run_id"], card["accuracy"], sum(p.numel() for p in model.parameters()))
"""


def test_the_export_container_is_made_like_the_ps_with_the_runs_id():
    doc = render_compose.render(load(REPO / "configs/cpu-smoke.yaml"))
    name, ps = export_container.exporting_service(doc)
    env = export_container.environment(ps, "run-7", "/tmp/export")
    assert name == "ps" and env["PSC_RUN_ID"] == "run-7" and env["PSC_EXPORT_DIR"] == "/tmp/export"
    assert env["PSC_MODEL"] == "cnn" and "PSC_RESUME" not in env  # deploy-time variables left out
    assert export_container.volumes(ps, "proj", REPO) == {"proj_state": {"bind": "/state", "mode": "rw"}}
    short = {"volumes": ["state:/state", "/srv/data:/data:ro"]}
    assert export_container.volumes(short, "p", REPO) == {
        "p_state": {"bind": "/state", "mode": "rw"},
        "/srv/data": {"bind": "/data", "mode": "ro"},
    }


def test_a_relative_bind_mount_is_given_to_the_engine_under_the_project_directory():
    """The README's cpu-resnet (data_dir) and the custom example (code:) mount relative host
    paths; the SDK takes only absolute ones (before: `APIError: 400 ... includes invalid
    characters for a local volume name`, exit 1)."""
    for config in ("configs/cpu-resnet.yaml", "examples/custom/topology.yaml"):
        _, ps = export_container.exporting_service(render_compose.render(load(REPO / config)))
        binds = {k: v for k, v in export_container.volumes(ps, "proj", REPO).items() if k != "proj_state"}
        assert binds and all(Path(k).is_absolute() and k.startswith(str(REPO)) for k in binds), binds
        assert all(v["mode"] == "ro" for v in binds.values()), binds
    home = export_container.volumes({"volumes": ["~/data:/data:ro"]}, "p", REPO)
    assert list(home) == [str(Path.home() / "data")]


def test_an_allreduce_run_is_exported_from_worker1_and_a_document_without_either_is_refused():
    assert export_container.exporting_service({"services": {"worker1": {"image": "x"}}})[0] == "worker1"
    with pytest.raises(UsageError, match="neither a ps nor a worker1 service"):
        export_container.exporting_service({"services": {"tensorboard": {}}})


def test_only_the_two_files_come_out_of_the_archive(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in [("export/model.pt", b"pt"), ("export/model.json", b"{}"), ("export/../evil", b"x")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    export_container.extract(buffer.getvalue(), tmp_path / "model")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["model.json", "model.pt"]
    with pytest.raises(UsageError, match="the export wrote no model.pt, model.json"):
        empty = io.BytesIO()
        tarfile.open(fileobj=empty, mode="w").close()
        export_container.extract(empty.getvalue(), tmp_path / "none")


def _orchestrator(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_make_local_runs_export_to_runs_name_model_and_load_as_plain_pytorch(tmp_path):
    config = str(REPO / "configs/cpu-smoke.yaml")
    ran = _orchestrator("local", "-c", config, "--workers", "1", "--name", "exported", cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    done = _orchestrator("export", "-c", config, "--name", "exported", "--local", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    into = tmp_path / "runs" / "exported" / "model"
    card = json.loads((into / "model.json").read_text())
    assert f"==> export: run {card['run_id']} of make local's exported" in done.stdout and card["finished"] is True
    accuracy = float(ran.stdout.split("Accuracy: ")[-1].split()[0])
    assert card["accuracy"] == pytest.approx(accuracy, abs=1e-4)
    loaded = subprocess.run([sys.executable, "-c", LOAD, str(into)], capture_output=True, text=True, cwd=REPO)
    assert loaded.returncode == 0 and loaded.stdout.split()[0] == card["run_id"], loaded.stderr
    again = _orchestrator("export", "-c", config, "--name", "exported", "--local", "--run", "nope", cwd=tmp_path)
    assert again.returncode == 2 and "RUN=nope: no such run in make local's runs of exported" in again.stderr


def _start_line(run_id: str) -> str:
    return json.dumps({"event": "start", "run_id": run_id, "time": 1.0, "step": 0})


def test_export_of_a_name_only_make_local_ran_says_to_add_local_and_one_beside_a_cluster_says_which(
    tmp_path, monkeypatch
):
    """(before: "project cpu-smoke has no run yet (no metrics): nothing to export", and where a
    compose run of the name existed, its model, silently, not the local run just made)"""
    from orchestrator.backends.registry import BACKENDS
    from orchestrator.verbs import export as export_verb

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    metrics = tmp_path / "runs" / "cpu-smoke" / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "ps.jsonl").write_text(_start_line("20261202-000000-abcdef") + "\n")
    compose = BACKENDS["compose"]
    config = str(REPO / "configs/cpu-smoke.yaml")
    monkeypatch.setattr(compose, "read_records", lambda c, service: {})
    with pytest.raises(UsageError) as said:
        export_verb.export(compose, config)
    assert "project cpu-smoke has no run yet (no metrics); make local's runs of cpu-smoke" in str(said.value)
    assert "--local (make export LOCAL=1), newest 20261202-000000-abcdef" in str(said.value)

    def exported(c, run_id, into):
        into.mkdir(parents=True, exist_ok=True)
        (into / "model.json").write_text(json.dumps({"run_id": run_id, "version": 9, "finished": True}))

    monkeypatch.setattr(
        compose, "read_records", lambda c, service: {"ps.jsonl": [_start_line("20261201-000000-fedcba")]}
    )
    monkeypatch.setattr(compose, "export_model", exported)
    out = io.StringIO()
    assert export_verb.export(compose, config, out=out) == 0
    assert "export: project cpu-smoke's run, not make local's runs of cpu-smoke" in out.getvalue()
    assert "==> export: run 20261201-000000-fedcba of project cpu-smoke" in out.getvalue()
