"""MLflow tracking and `make tensorboard` for real: a finished cpu-smoke run in containers with
`tracking.mlflow: true`, its PS tracking it to the project's own `mlflow server` (its image built
from the offline base; the run read back with MLflow's client on the host's published port), the
project's `tensorboard` service answering TensorBoard's scalars API with the JSONL records' values,
a headless Chromium screenshot of its scalars page showing the accuracy curve
(docs/img/tensorboard.png), and `make down` removing both services with the rest, the volumes kept."""

from __future__ import annotations

import io
import ipaddress
import json
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import mlflow_testkit
import numpy
import pytest
import yaml
from engine_networks import using_networks
from PIL import Image

from orchestrator import images
from orchestrator.backends import command
from orchestrator.backends.compose import adapter
from orchestrator.backends.registry import BACKENDS
from orchestrator.metrics.records import parse_lines
from orchestrator.paths import ROOT, RUNS
from orchestrator.render import tracking
from orchestrator.render.compose import TENSORBOARD_SERVICE
from orchestrator.topology.model import load
from orchestrator.verbs import board
from orchestrator.verbs import cluster as verbs

from app_testkit import free_port
from needs import unavailable

# In the engine group beside `engine` (tests/conftest.py): its projects are its own.
pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.xdist_group("engine-2")]

TAG = "ps-compose-tensorboard-test:latest"  # its own tag: the cpu-smoke image of this tree
SCREENSHOT = ROOT / "docs" / "img" / "tensorboard.png"


@pytest.fixture(scope="module")
def image(engine):
    t = load(str(ROOT / "configs/cpu-smoke.yaml"))
    base, pip_source = images.source(t, offline=True)
    images.build(TAG, base, pip_source)
    return TAG


@pytest.fixture(scope="module")
def chromium():
    try:
        found = subprocess.run([str(ROOT / ".ci/chromium.sh")], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        unavailable(f"no chromium: .ci/chromium.sh: {e}")
    if found.returncode != 0:
        unavailable(f"no chromium: .ci/chromium.sh: {found.stderr.strip()[-300:]}")
    return found.stdout.strip().splitlines()[-1]


def get(port: int, path: str, **query: str):
    q = f"?{urllib.parse.urlencode(query)}" if query else ""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}{q}", timeout=30) as r:
        return json.loads(r.read())


def screenshot(chromium: str, url: str, path: Path) -> numpy.ndarray:
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={path}",
         "--window-size=1280,800", "--virtual-time-budget=20000", url],
        check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    return numpy.asarray(Image.open(path).convert("RGB")).astype(int)


def coloured(pixels: numpy.ndarray) -> numpy.ndarray:
    """Where a pixel has a colour (not white, grey or black): a curve's run colour."""
    return (pixels.max(axis=2) - pixels.min(axis=2)) > 60


@dataclass
class FinishedRun:
    """A cpu-smoke run in containers, finished, its PS tracking it to the project's MLflow server."""

    project: str
    config: Path
    run_id: str
    evals: list[dict]
    mlflow: str  # the tracking server's UI and API on the host
    said: str  # the PS's lines about MLflow and the server's last lines: why, when it went wrong


@pytest.fixture(scope="module")
def finished(engine, image, tmp_path_factory):
    """`make up` of cpu-smoke (4 epochs) with `tracking.mlflow: true`, its server published on a
    free port of the host's loopback (PSC_MLFLOW_PORT), as two projects on one host need. Waited
    to its end; `down -v` at the end."""
    project = f"tb-{uuid.uuid4().hex[:8]}"
    root = tmp_path_factory.mktemp("tracked")
    doc = yaml.safe_load((ROOT / "configs/cpu-smoke.yaml").read_text())
    doc["name"], doc["image"]["tag"] = project, image
    doc["train"]["epochs"] = 4
    doc["train"]["eval_every"] = 50
    doc["tracking"] = {"mlflow": True, "auth": True}  # its basic auth: the caller's user and password
    config = root / "tb.yaml"
    config.write_text(yaml.safe_dump(doc))
    found = adapter.detect()
    proj = adapter.Project(project, str(BACKENDS["compose"].path_of(project)), str(ROOT))
    port = free_port()
    # its network lives as long as the module: a swarm leave meanwhile would drop its names
    with using_networks(), pytest.MonkeyPatch.context() as env:
        env.setenv(tracking.MLFLOW_PORT, str(port))
        env.setenv("MLFLOW_TRACKING_USERNAME", "alice")  # the tests' MLflow clients log in with them too
        env.setenv("MLFLOW_TRACKING_PASSWORD", f"Pw-{uuid.uuid4().hex}")
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        env.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        try:
            said = io.StringIO()
            assert verbs.up(BACKENDS["compose"], str(config), name=project, remember=False, out=said) == 0
            assert (
                f"==> MLflow: the run is tracked at http://127.0.0.1:{port} (experiment {project}, user alice)"
                in said.getvalue()
            )
            states = adapter.wait_exited(engine, project, 3, 600, io.StringIO())
            assert states and all(s.exit_code == 0 for s in states), states
            server = [c for c in adapter.containers(engine, project) if adapter.service_of(c) == "mlflow"]
            assert [c.status for c in server] == ["running"]  # it outlives the run, for its UI
            metrics = adapter.read_metrics(engine, project, adapter.containers(engine, project))
            records = parse_lines(metrics["ps.jsonl"])
            [run_id] = {r["run_id"] for r in records if r["event"] == "start"}
            evals = [r for r in records if r["event"] in ("eval", "end")]
            assert [r for r in evals if r["event"] == "eval"], records
            ps_log = adapter.log_text(engine, project, "ps").splitlines()
            ps_lines = [line for line in ps_log if "MLflow" in line or "View run" in line]
            server_lines = adapter.log_text(engine, project, "mlflow").splitlines()[-20:]
            said = "\n".join(["the PS:", *ps_lines, "the server:", *server_lines])
            yield FinishedRun(project, config, run_id, evals, f"http://127.0.0.1:{port}", said)
        finally:
            command.run(adapter.down_argv(found, proj, volumes=True), capture=True, check=False)
            shutil.rmtree(RUNS / project, ignore_errors=True)


def test_the_ps_in_a_container_logs_its_run_to_mlflow(finished):
    """The run's parameters, its accuracy curve (the PS's `eval` and `end` records, the version as
    the step), the exported model and FINISHED, read back with MLflow's client."""
    from mlflow import MlflowClient

    with pytest.raises(urllib.error.HTTPError) as refused:  # tracking.auth: no user, no answer
        urllib.request.urlopen(f"{finished.mlflow}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30)
    assert refused.value.code == 401
    client = MlflowClient(finished.mlflow)  # as alice (the environment)
    experiment = client.get_experiment_by_name(finished.project)  # the experiment: the run's name
    assert experiment is not None, f"no experiment: the PS's container did not reach the server\n{finished.said}"
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`ps-compose.run_id` = '{finished.run_id}'"
    )
    assert len(runs) == 1, runs
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == finished.run_id
    assert run.data.params["train.model"] == "cnn" and run.data.params["train.epochs"] == "4"
    curve = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "accuracy"))
    assert curve == sorted((r["step"], r["accuracy"]) for r in finished.evals)
    names = sorted(f.path for f in client.list_artifacts(run.info.run_id, "export"))
    assert names == ["export/model.json", "export/model.pt"]
    mlflow_model = {f.path for f in client.list_artifacts(run.info.run_id, "model")}
    assert {"model/MLmodel", "model/data", "model/input_example.json"} <= mlflow_model, mlflow_model
    # The run's address in the PS's log is the host's (not http://mlflow:5000, the network's), said
    # as the run opens (its `finished` line waits on the last requests, which a loaded host may
    # not answer within the PS's 15 s at its end: MLflow has the run whole all the same, above).
    address = f"{finished.mlflow}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}"
    assert f"MLflow run {finished.run_id}: {address}" in finished.said, finished.said
    addresses = [line for line in finished.said.splitlines() if "MLflow run " in line]
    assert "View run" not in finished.said and not [line for line in addresses if "http://mlflow:" in line]
    password = os.environ["MLFLOW_TRACKING_PASSWORD"]  # the server's admin's (the fixture's)
    rendered = Path(BACKENDS["compose"].path_of(finished.project)).read_text()
    assert password not in finished.said and password not in rendered


def test_the_mlflow_servers_image_is_a_python_without_torch(engine, finished):
    """The server imports no torch: its image is FROM the offline base's Python, not the base
    (before: 5.83 GB, the base's torch pair in it)."""
    image = engine.images.get(tracking.MLFLOW_IMAGE)
    assert image.attrs["Size"] < 1.5e9, f"{image.attrs['Size'] / 1e9:.2f} GB"
    probe = "import importlib.util as u, mlflow; print(u.find_spec('torch') is None, mlflow.__version__)"
    said = engine.containers.run(tracking.MLFLOW_IMAGE, ["-c", probe], entrypoint="python", remove=True)
    assert said.decode().split()[0] == "True", said


def test_tensorboard_shows_a_finished_cpu_smoke_run_and_down_removes_it(engine, finished, chromium, tmp_path):
    project, config, run_id = finished.project, finished.config, finished.run_id
    evals = [r for r in finished.evals if r["event"] == "eval"]
    out = io.StringIO()
    assert board.tensorboard(BACKENDS["compose"], str(config), name=project, out=out) == 0
    port = int(re.search(r"==> tensorboard: http://127\.0\.0\.1:(\d+)/ \(every run", out.getvalue()).group(1))
    tags = get(port, "/data/plugin/scalars/tags")
    run = f"{run_id}/ps"
    assert {"eval/accuracy", "eval/loss", "eval/updates_per_s", "eval/workers"} <= set(tags[run]), tags
    assert {"train/loss", "train/step_seconds"} <= set(tags[f"{run_id}/worker1"]), tags
    points = get(port, "/data/plugin/scalars/scalars", run=run, tag="eval/accuracy")
    assert [(step, numpy.float32(v)) for _, step, v in points] == [
        (r["step"], numpy.float32(r["accuracy"])) for r in evals
    ]
    # A trained model's curve: 4 epochs are ~150 updates, which end at 0.90-0.95 as processes
    # (13 runs), lower in a loaded CI's containers; the smokes hold a finished 10-epoch run
    # to 0.90. Here the curve must rise from its first point to a model well past chance.
    course = [(step, round(v, 4)) for _, step, v in points]
    assert points[-1][2] >= 0.8 and points[-1][2] > points[0][2], course

    # The scalars page, accuracy alone, against the same page with a filter no tag matches:
    # the curve is what the first has in colour and the second has not, across the chart.
    page = f"http://127.0.0.1:{port}/?darkMode=false#scalars&tagFilter="
    shown = screenshot(chromium, page + urllib.parse.quote("^eval/accuracy$"), tmp_path / "accuracy.png")
    empty = screenshot(chromium, page + "no-such-tag", tmp_path / "empty.png")
    curve = coloured(shown) & ~coloured(empty)
    columns = numpy.flatnonzero(curve.any(axis=0))
    assert curve.sum() > 300 and columns.size and columns[-1] - columns[0] > 200, (
        f"no accuracy curve drawn: {curve.sum()} coloured pixels over {columns.size} columns"
    )
    if os.environ.get("UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(tmp_path / "accuracy.png", SCREENSHOT)

    said = io.StringIO()
    assert verbs.down(BACKENDS["compose"], str(config), name=project, out=said) == 0
    assert f"kept in volume {project}_state, MLflow's runs in {project}_mlflow" in said.getvalue(), said.getvalue()
    left = [adapter.service_of(c) for c in adapter.containers(engine, project)]
    assert TENSORBOARD_SERVICE not in left and left == [], left
    kept = sorted(v.name for v in engine.volumes.list(filters={"label": f"com.docker.compose.project={project}"}))
    assert kept == [f"{project}_mlflow", f"{project}_state"]  # `make down` keeps the runs and checkpoints


def test_a_basic_auth_server_on_the_host_gets_the_run_from_compose_and_the_password_is_written_nowhere(
    engine, image, tmp_path_factory
):
    """A server of the user's own with MLflow's basic auth, on the Docker bridge's gateway (the
    host's address the containers reach), the credentials in MLflow's own variables of the `up`
    call: the PS alone gets them, the run reaches the server, and the password is in no rendered
    file, no file under runs/ and no container's log."""
    from mlflow import MlflowClient

    ipam = engine.networks.get("bridge").attrs["IPAM"]["Config"][0]  # Docker 20.10 names no gateway: the first host
    gateway = ipam.get("Gateway") or str(next(ipaddress.ip_network(ipam["Subnet"]).hosts()))
    user, password = "alice", f"Pw-{uuid.uuid4().hex}"
    project = f"auth-{uuid.uuid4().hex[:8]}"
    doc = yaml.safe_load((ROOT / "configs/cpu-smoke.yaml").read_text())
    doc["name"], doc["image"]["tag"] = project, image
    doc["train"]["epochs"] = 2
    root = tmp_path_factory.mktemp("auth")
    config = root / "auth.yaml"
    config.write_text(yaml.safe_dump(doc))
    found = adapter.detect()
    proj = adapter.Project(project, str(BACKENDS["compose"].path_of(project)), str(ROOT))
    with mlflow_testkit.serve(root / "server", gateway, free_port(), (user, password)) as uri:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("MLFLOW_TRACKING_URI", uri)
            env.setenv("MLFLOW_TRACKING_USERNAME", user)
            env.setenv("MLFLOW_TRACKING_PASSWORD", password)
            env.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
            try:
                assert verbs.up(BACKENDS["compose"], str(config), name=project, remember=False, out=io.StringIO()) == 0
                states = adapter.wait_exited(engine, project, 3, 600, io.StringIO())
                assert states and all(s.exit_code == 0 for s in states), states
                logs = {s: adapter.log_text(engine, project, s) for s in ("ps", "worker1", "worker2")}
                client = MlflowClient(uri)
                experiment = client.get_experiment_by_name(project)
                assert experiment is not None, logs["ps"][-2000:]
                (run,) = client.search_runs([experiment.experiment_id])
                assert run.info.status == "FINISHED" and client.get_metric_history(run.info.run_id, "accuracy")
                for container in adapter.containers(engine, project):
                    names = {e.split("=", 1)[0] for e in container.attrs["Config"]["Env"]}
                    service = adapter.service_of(container)
                    assert ("MLFLOW_TRACKING_PASSWORD" in names) == (service == "ps"), (service, names)
                assert not [s for s, text in logs.items() if password in text]
                written = [
                    f for f in (RUNS / project).rglob("*") if f.is_file() and password.encode() in f.read_bytes()
                ]
                assert not written and password not in Path(proj.file).read_text()
            finally:
                command.run(adapter.down_argv(found, proj, volumes=True), capture=True, check=False)
                shutil.rmtree(RUNS / project, ignore_errors=True)
