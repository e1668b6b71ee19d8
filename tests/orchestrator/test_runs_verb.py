"""`ps-compose runs`, `runs show`, `runs rm`: local runs are real `orchestrator local` runs (a
stand-in app that writes the PS's records as the app does: `start` with the run id, `eval`,
`end`); a compose run is a real state volume and record on the engine (no image built)."""

from __future__ import annotations

import io
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from needs import unavailable
from orch_helpers import topology

# The app's records as app/contract.py has them, into PSC_METRICS_DIR; FAKE_SLEEP: the PS stays.
FAKE_APP = """
import json, os, sys, time
role = sys.argv[1]
name = "ps" if role == "ps" else "worker" + os.environ["PSC_RANK"]
if role == "ps":
    def rec(**r):
        with open(os.path.join(os.environ["PSC_METRICS_DIR"], "ps.jsonl"), "a") as f:
            f.write(json.dumps({"time": time.time(), "role": "ps", "rank": 0, **r}) + "\\n")
    rec(event="start", step=0, run_id=os.environ["PSC_RUN_ID"])
    rec(event="eval", step=40, loss=0.5, accuracy=0.75)
    if os.environ.get("FAKE_SLEEP"):
        open("ps.started", "w").close()
        time.sleep(120)
    rec(event="end", step=80, loss=0.25, accuracy=0.9375)
"""


@pytest.fixture
def here(tmp_path: Path) -> Path:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "__main__.py").write_text(FAKE_APP)
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topology()))
    return tmp_path


def orch(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def listed(cwd: Path) -> list[dict]:
    p = orch(cwd, "runs", "--target", "local", "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_runs_lists_each_local_run_with_its_id_state_steps_and_metric(here: Path) -> None:
    for _ in range(2):
        assert orch(here, "local", "-c", "topo.yaml").returncode == 0
    rows = listed(here)
    assert [r["name"] for r in rows] == ["t", "t"]
    assert rows[0]["run_id"] != rows[1]["run_id"]
    # in the order they ran: the lock names the last run's id (two ids of one second sort by chance)
    assert rows[1]["run_id"] == json.loads((here / "runs" / "t" / "local.lock").read_text())["run_id"]
    for r in rows:
        assert list(r) == ["name", "run_id", "target", "state", "started", "steps", "metric", "value", "where"]
        assert (r["target"], r["state"], r["steps"], r["metric"], r["value"]) == (
            "local",
            "finished",
            80,
            "accuracy",
            0.9375,
        )
        assert r["where"] == "runs/t/" and r["started"].endswith("Z")
    table = orch(here, "runs", "--target", "local").stdout.splitlines()
    assert table[0].split()[:3] == ["NAME", "RUN", "ID"] and len(table) == 3
    assert rows[1]["run_id"] in table[2] and "accuracy 0.9375" in table[2]
    shown = orch(here, "runs", "show", rows[0]["run_id"], "--json")
    assert json.loads(shown.stdout) == rows[0]
    newest = orch(here, "runs", "show", "t")  # a name: its newest run
    assert f"run_id:   {rows[1]['run_id']}" in newest.stdout.splitlines()


def test_runs_show_of_an_unknown_run_is_one_line_and_exit_2(here: Path) -> None:
    assert orch(here, "local", "-c", "topo.yaml").returncode == 0
    p = orch(here, "runs", "show", "nope", "--target", "local")
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1
    assert "'nope'" in p.stderr and "names: t" in p.stderr, p.stderr


@pytest.mark.docker  # its last call: a name with no run anywhere, which the engine is asked about
def test_a_live_local_run_is_running_and_runs_rm_refuses_it_until_it_ends(here: Path) -> None:
    live = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "local", "-c", "topo.yaml"],
        cwd=here,
        env={**os.environ, "FAKE_SLEEP": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (here / "ps.started").exists():
            assert live.poll() is None and time.monotonic() < deadline, "the PS never started"
            time.sleep(0.1)
        (row,) = listed(here)
        assert (row["state"], row["steps"], row["value"]) == ("running", 40, 0.75)
        lock = json.loads((here / "runs" / "t" / "local.lock").read_text())
        assert row["run_id"] == lock["run_id"]
        p = orch(here, "runs", "rm", "t", "--volumes")
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
        assert f"live local run {row['run_id']}" in p.stderr
        assert (here / "runs" / "t" / "metrics" / "ps.jsonl").is_file()
    finally:
        live.send_signal(signal.SIGTERM)
        live.wait(timeout=60)
    (row,) = listed(here)
    assert row["state"] == "stopped"  # no `end` record
    kept = orch(here, "runs", "rm", "t")
    assert kept.returncode == 0, kept.stderr
    assert sorted(p.name for p in (here / "runs" / "t").iterdir()) == ["checkpoints", "metrics"]
    assert listed(here) == [row]  # its state kept: still listed
    gone = orch(here, "runs", "rm", "t", "--volumes")
    assert gone.returncode == 0 and not (here / "runs" / "t").exists()
    assert listed(here) == []
    again = orch(here, "runs", "rm", "t")
    if again.returncode == 1 and "docker" in again.stderr.lower():
        unavailable(f"no Docker engine answers: {again.stderr.strip()}")
    assert again.returncode == 2 and "no run named 't'" in again.stderr


BASE_IMAGE = "ps-compose-base:bookworm"


@pytest.mark.slow
@pytest.mark.docker
def test_a_compose_runs_state_volume_is_listed_and_rm_volumes_removes_it(tmp_path: Path) -> None:
    """A state volume as compose makes it (its labels), with the PS's records in metrics/, and
    the record of its up: listed from the volume; `rm` without --volumes keeps the volume."""
    import docker

    try:
        client = docker.from_env()
        client.images.get(BASE_IMAGE)
    except Exception as e:  # noqa: BLE001 - no engine or no base image here
        unavailable(f"no Docker engine or no {BASE_IMAGE} image: {e}")
    from orchestrator.backends import record
    from orchestrator.backends.base import Cluster
    from orchestrator.backends.registry import get
    from orchestrator.errors import UsageError
    from orchestrator.verbs import inventory

    compose = get("compose")
    name = f"psc-runs-{secrets.token_hex(3)}"
    file = tmp_path / name / "compose.yaml"
    file.parent.mkdir()
    file.write_text(
        f"services:\n  ps:\n    image: {BASE_IMAGE}\n    command: ['true']\n    volumes: ['state:/state']\n"
        "volumes:\n  state: {}\n"
    )
    run_id = "20261202-130000-abcdef"
    lines = [
        {"time": 1764680400, "role": "ps", "event": "start", "step": 0, "run_id": run_id},
        {"time": 1764680460, "role": "ps", "event": "end", "step": 430, "loss": 0.1, "accuracy": 0.97},
    ]
    text = "".join(json.dumps(r) + "\n" for r in lines)
    from orchestrator.backends.compose.backend import _compose

    argv = [*_compose().prefix, "-p", name, "-f", str(file)]
    subprocess.run([*argv, "up", "--no-build"], check=True, capture_output=True)
    try:
        client.containers.run(
            BASE_IMAGE,
            ["sh", "-c", f"mkdir -p /state/metrics && printf '%s' '{text}' > /state/metrics/ps.jsonl"],
            volumes={f"{name}_state": {"bind": "/state", "mode": "rw"}},
            remove=True,
        )
        record.save(compose, Cluster(name, file), runs=tmp_path)
        out = io.StringIO()
        assert inventory.list_runs(tmp_path, target="compose", as_json=True, out=out) == 0
        (row,) = [r for r in json.loads(out.getvalue()) if r["name"] == name]
        assert (row["run_id"], row["target"], row["state"], row["steps"], row["value"]) == (
            run_id,
            "compose",
            "finished",
            430,
            0.97,
        )
        assert row["where"] == f"volume {name}_state" and row["started"] == "2025-12-02T13:00:00Z"
        said = io.StringIO()
        assert inventory.remove(name, tmp_path, volumes=False, out=said) == 0
        assert client.volumes.get(f"{name}_state") and not record.path(compose, tmp_path, name).exists()
        # the record gone, the volume still says it is the project's: still listed, and removable
        out = io.StringIO()
        inventory.list_runs(tmp_path, target="compose", as_json=True, out=out)
        assert [r["run_id"] for r in json.loads(out.getvalue()) if r["name"] == name] == [run_id]
        with pytest.raises(UsageError, match="only its state is left .* --volumes removes it"):
            inventory.remove(name, tmp_path)
        assert inventory.remove(name, tmp_path, volumes=True, out=said) == 0
        assert not client.volumes.list(filters={"name": f"{name}_state"})
        assert said.getvalue().splitlines()[-1] == f"==> runs rm: project {name}: its volume removed"
    finally:
        subprocess.run([*argv, "down", "-v"], capture_output=True)
        for left in client.volumes.list(filters={"name": f"{name}_state"}):
            left.remove(force=True)


def test_a_resumed_runs_first_record_is_not_the_run_before_it():
    """A PS that resumes writes `resume` (of the checkpoint's run) before its `start`: run B,
    which finished before run A was resumed (`--resume A`), stays finished at its own step."""
    records = [
        {"event": "start", "run_id": "A", "time": 1, "step": 0},
        {"event": "eval", "step": 20, "accuracy": 0.5, "time": 2},
        {"event": "start", "run_id": "B", "time": 3, "step": 0},
        {"event": "end", "step": 8, "accuracy": 0.9, "time": 4},
        {"event": "resume", "run_id": "A", "step": 20, "time": 5},
        {"event": "start", "run_id": "A", "time": 5, "step": 20},
        {"event": "eval", "step": 30, "accuracy": 0.6, "time": 6},
    ]
    from orchestrator.verbs import inventory

    rows = inventory.rows_of("t", "local", "", {"ps.jsonl": [json.dumps(r) for r in records]}, None)
    assert [(r["run_id"], r["state"], r["steps"]) for r in rows] == [("A", "stopped", 30), ("B", "finished", 8)]


def test_runs_rm_of_a_local_run_needs_no_docker_engine(here: Path) -> None:
    """With no engine answering, a local run is still removed (its state kept, then with
    --volumes); a name with no local run is the engine's one line (its clusters are unknown)."""
    assert orch(here, "local", "-c", "topo.yaml").returncode == 0
    no_engine = {"DOCKER_HOST": f"unix://{here}/no-engine.sock"}
    kept = orch(here, "runs", "rm", "t", **no_engine)
    assert kept.returncode == 0 and "local t removed" in kept.stdout, kept.stderr
    gone = orch(here, "runs", "rm", "t", "--volumes", **no_engine)
    assert gone.returncode == 0 and not (here / "runs" / "t").exists(), gone.stderr
    unknown = orch(here, "runs", "rm", "t", **no_engine)
    assert unknown.returncode == 1 and "no-engine.sock" in unknown.stderr, unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1


def test_a_bad_byte_in_one_runs_records_breaks_no_listing(here: Path) -> None:
    for name in ("t", "u"):
        assert orch(here, "local", "-c", "topo.yaml", "--name", name).returncode == 0
    with open(here / "runs" / "u" / "metrics" / "ps.jsonl", "ab") as f:
        f.write(b"\xff\n")
    rows = listed(here)
    assert sorted(r["name"] for r in rows) == ["t", "u"] and {r["state"] for r in rows} == {"finished"}
    for args in (("runs", "--target", "local"), ("runs", "show", "u")):
        p = orch(here, *args)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
