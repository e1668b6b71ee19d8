"""The PS's run in MLflow (app/training/tracking.py): a real tracking server (sqlite backend) reads
back the run's parameters, curves, exported model and end; a tracker that is down costs one
warning and the run goes on; one that is slow to answer still gets the whole run."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import mlflow_testkit
import pytest

from app.config import parse
from app.contract import shown
from app.training import tracking
from app.training.metrics import read, training_parameters

from app_testkit import DIGITS, app_env, final_accuracy, free_port, run_cluster


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 with a sqlite store; its URI."""
    with mlflow_testkit.serve(tmp_path_factory.mktemp("mlflow"), "127.0.0.1", free_port()) as uri:
        yield uri


@pytest.mark.slow
def test_the_ps_logs_its_run_to_mlflow_params_curves_model_and_end(tmp_path, mlflow_server):
    from mlflow import MlflowClient

    env = app_env(MLFLOW_TRACKING_URI=mlflow_server, MLFLOW_EXPERIMENT_NAME="tracked-digits")
    args = [*DIGITS, "--num_epochs", "3", "--eval_every", "40", "--run_id", "tracked-1"]
    procs = run_cluster(tmp_path, workers=2, args=args, timeout=240, env=env)
    assert all(p.returncode == 0 for p in procs.values()), {n: p.stderr[-600:] for n, p in procs.items()}
    warned = [line for line in procs["ps"].stderr.splitlines() if "MLflow" in line and "INFO" not in line]
    assert not warned  # no warning: the tracker took every record

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("tracked-digits")
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`ps-compose.run_id` = 'tracked-1'")
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked-1"
    assert run.data.params["train.lr"] == "0.1" and run.data.params["train.model"] == "cnn"
    assert run.data.params["workers.count"] == "2" and run.data.params["train.strategy"] == "async"
    records = read(tmp_path / "metrics" / "ps.jsonl")
    evals = [(r["step"], r["accuracy"]) for r in records if r["event"] in ("eval", "end")]
    curve = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "accuracy"))
    assert curve == sorted(evals) and curve[-1][1] == final_accuracy(procs["ps"].stdout)
    assert {m.key for m in client.get_metric_history(run.info.run_id, "samples_per_s")} == {"samples_per_s"}
    # Each worker's training loss and samples/s, as its pushes carried them: every progress line's
    # but one at most (the last report of a worker may come after its last push), at the PS's versions.
    last_version = max(step for step, _ in evals)
    for worker in ("worker1", "worker2"):
        trained = [r["loss"] for r in read(tmp_path / "metrics" / f"{worker}.jsonl") if r["event"] == "train"]
        losses = client.get_metric_history(run.info.run_id, f"{worker}/loss")
        assert len(trained) - 1 <= len(losses) <= len(trained), (len(trained), len(losses))
        assert [m.value for m in sorted(losses, key=lambda m: m.step)] == trained[: len(losses)]
        assert all(0 < m.step <= last_version for m in losses)
        assert len(client.get_metric_history(run.info.run_id, f"{worker}/samples_per_s")) == len(losses)
    names = sorted(f.path for f in client.list_artifacts(run.info.run_id, "export"))
    assert names == ["export/model.json", "export/model.pt"]
    card = json.loads(Path(client.download_artifacts(run.info.run_id, "export/model.json", str(tmp_path))).read_text())
    assert card["builder"] == "app.training.models:SmallCNN" and card["run_id"] == "tracked-1"
    _the_mlflow_model_loads_predicts_and_registers(mlflow_server, run.info.run_id, card["input"])
    # The run's address, once opened and once finished; not MLflow's own "View run" line.
    address = f"{mlflow_server}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}"
    output = procs["ps"].stdout + procs["ps"].stderr
    assert f"MLflow run tracked-1: {address}" in output and f"MLflow run tracked-1 finished: {address}" in output
    assert "View run" not in output


def _the_mlflow_model_loads_predicts_and_registers(uri: str, run_id: str, inputs: dict) -> None:
    """The run's `model` artifact is an MLflow model: mlflow.pytorch.load_model loads it, its
    signature says the input's and output's shapes with the batch free, it predicts a batch of
    10 classes for the input example, and the registry takes it."""
    import mlflow
    import mlflow.pytorch
    import numpy as np
    import torch

    mlflow.set_tracking_uri(uri)
    model_uri = f"runs:/{run_id}/model"
    info = mlflow.models.get_model_info(model_uri)
    signature = info.signature.to_dict()
    assert json.loads(signature["inputs"])[0]["tensor-spec"]["shape"] == [-1, inputs["channels"], 8, 8]
    assert json.loads(signature["outputs"])[0]["tensor-spec"]["shape"] == [-1, 10]
    model = mlflow.pytorch.load_model(model_uri)
    local = mlflow.artifacts.download_artifacts(model_uri)
    example = np.asarray(mlflow.models.Model.load(local).load_input_example(local), dtype=np.float32)
    with torch.no_grad():
        assert model(torch.from_numpy(example)).shape == (len(example), 10)
    version = mlflow.register_model(model_uri, "tracked-digits-model")
    assert int(version.version) >= 1


@pytest.mark.slow
def test_a_server_with_basic_auth_gets_the_run_and_the_password_is_written_nowhere(
    tmp_path, tmp_path_factory, monkeypatch
):
    """MLflow's own MLFLOW_TRACKING_USERNAME/PASSWORD, in the PS's environment: the run reaches a
    server started with `--app-name basic-auth`; the password is in no file the run wrote and in
    no line it printed."""
    from mlflow import MlflowClient

    user, password = "alice", f"Pw-{uuid.uuid4().hex}"
    with mlflow_testkit.serve(
        tmp_path_factory.mktemp("mlflow-auth"), "127.0.0.1", free_port(), (user, password)
    ) as uri:
        with pytest.raises(urllib.error.HTTPError) as refused:  # the server wants credentials
            urllib.request.urlopen(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30)
        assert refused.value.code == 401
        env = app_env(MLFLOW_TRACKING_URI=uri, MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password)
        args = [*DIGITS, "--num_epochs", "2", "--run_id", "auth-1"]
        procs = run_cluster(tmp_path, workers=1, args=args, timeout=240, env=env)
        assert all(p.returncode == 0 for p in procs.values()), {n: p.stderr[-600:] for n, p in procs.items()}
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        client = MlflowClient(uri)
        (run,) = client.search_runs(
            [client.get_experiment_by_name(tracking.DEFAULT_EXPERIMENT).experiment_id],
            filter_string="tags.`ps-compose.run_id` = 'auth-1'",
        )
        assert run.info.status == "FINISHED" and client.get_metric_history(run.info.run_id, "accuracy")
    for p in procs.values():
        assert password not in p.stdout + p.stderr
    written = [f for f in tmp_path.rglob("*") if f.is_file() and password.encode() in f.read_bytes()]
    assert not written, written


@pytest.mark.slow
def test_a_tracker_that_is_down_costs_two_warnings_and_the_run_goes_on(tmp_path):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = app_env(MLFLOW_TRACKING_URI=down)
    procs = run_cluster(
        tmp_path, workers=1, args=[*DIGITS, "--num_epochs", "2", "--run_id", "untracked"], timeout=240, env=env
    )
    assert all(p.returncode == 0 for p in procs.values()), {n: p.stderr[-600:] for n, p in procs.items()}
    warnings = [line for line in procs["ps"].stderr.splitlines() if "MLflow" in line]
    # one when it stops answering, one at the end for what was never sent
    assert len(warnings) == 2, warnings
    assert f"MLflow tracking at {down} failed" in warnings[0] and "trying again until the run ends" in warnings[0]
    assert "did not take the run's last records (nothing taken for 15 s)" in warnings[1], warnings
    assert final_accuracy(procs["ps"].stdout) >= 0.8


@contextlib.contextmanager
def first_write(upstream: str, *, hold: float = 0.0, refuse: bool = False, lose: str = "") -> Iterator[str]:
    """An HTTP proxy to `upstream` whose first POST is answered `hold` seconds late (a server whose
    disk or CPU is busy), or, with `refuse`, not sent on but answered 503 (a server restarting);
    with `lose`, the first POST whose path ends with it is sent on and done, but its answer is
    lost: 503 (MLflow's client then sends it again). Every other request is sent on and
    answered as `upstream` answered it. Its URI."""
    first = threading.Event()

    class Forward(http.server.BaseHTTPRequestHandler):
        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if self.command == "POST" else None
            is_first = self.command == "POST" and not first.is_set() and self.path.endswith(lose)
            if is_first:
                first.set()
            if is_first and refuse:
                status, data = 503, b'{"error_code": "TEMPORARILY_UNAVAILABLE"}'
            else:
                request = urllib.request.Request(
                    upstream + self.path, data=body, method=self.command,
                    headers={"Content-Type": self.headers.get("Content-Type") or "application/json"},
                )  # fmt: skip
                try:
                    with urllib.request.urlopen(request, timeout=60) as answer:
                        status, data = answer.status, answer.read()
                except urllib.error.HTTPError as refused:
                    status, data = refused.code, refused.read()
                time.sleep(hold if is_first else 0.0)
                if is_first and lose:
                    status, data = 503, b'{"error_code": "TEMPORARILY_UNAVAILABLE"}'

            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _forward

        def log_message(self, *args) -> None:
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{proxy.server_address[1]}"
        assert first.is_set(), "no write went through the proxy"
    finally:
        proxy.shutdown()
        proxy.server_close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("server", "name"),
    [
        pytest.param({"hold": 12.0}, "slow-1", id="first-write-answered-in-12-s"),
        pytest.param({"refuse": True}, "refused-1", id="first-write-refused-503"),
    ],
)
def test_a_tracker_whose_server_is_slow_or_refuses_once_still_gets_the_whole_run(
    mlflow_server, server, name, monkeypatch, caplog
):
    """MLflow answering a write in 12 s (its disk busy with a loaded host's image builds), or once
    with 503, is slow or busy, not down: the run is tracked whole, once, with no warning."""
    from mlflow import MlflowClient

    for key in tracking.HTTP_DEFAULTS:  # the tracker sets its defaults; the test's end removes them
        monkeypatch.setenv(key, "")  # recorded as it was (unset), so that the undo unsets it
        monkeypatch.delenv(key)
    with first_write(mlflow_server, **server) as uri:
        tracker = tracking.Tracker(uri, "slow-server", name)
        tracker.params({"train.lr": 0.1})
        tracker.record("start", 0, {})
        tracker.record("eval", 40, {"accuracy": 0.5, "loss": 1.5})
        tracker.record("end", 80, {"accuracy": 0.75, "loss": 0.75, "seconds": 9.0})
        tracker.close(timeout=120)
    assert not tracker.failed and not [r for r in caplog.records if "MLflow" in r.getMessage()], caplog.text

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("slow-server")
    (run,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.`ps-compose.run_id` = '{name}'")
    assert run.info.status == "FINISHED" and run.data.params == {"train.lr": "0.1"}
    curve = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "accuracy"))
    assert curve == [(40, 0.5), (80, 0.75)]


def test_the_parameters_are_the_topologys_training_keys():
    config = parse(["ps", "--lr", "0.05", "--batch_size", "16", "--world_size", "4"], {})
    params = training_parameters(config)
    assert params["train.lr"] == 0.05 and params["train.batch_size"] == 16 and params["workers.count"] == 3
    assert all(k.startswith(("train.", "workers.", "ps.")) for k in params)


class _SlowClient:
    """An MlflowClient's calls the tracker makes; its first log_batch (the parameters) waits for
    `release`, so the records that come meanwhile queue up behind it."""

    def __init__(self) -> None:
        import threading

        self.release, self.batches, self.ended, self.runs = threading.Event(), [], [], []

    def get_experiment_by_name(self, name):
        return None

    def create_experiment(self, name):
        return "1"

    def search_runs(self, *args, **kwargs):
        return list(self.runs)

    def create_run(self, experiment, run_name, tags):
        from types import SimpleNamespace

        self.runs.append(SimpleNamespace(info=SimpleNamespace(run_id=f"r{len(self.runs) + 1}")))
        return self.runs[-1]

    def log_batch(self, run_id, metrics=(), params=()):
        if params:
            self.release.wait(10)
        if metrics:
            self.batches.append(sorted({(m.key, m.step) for m in metrics if m.key == "accuracy"}))

    def set_terminated(self, run_id, status):
        self.ended.append(status)


def test_the_records_queued_while_a_request_is_out_go_in_one_request(monkeypatch):
    """The tracker batches: while MLflow is slow with one write, the evaluations that come are
    sent together in the next request, not one request each (the run's end comes in time)."""
    client = _SlowClient()
    monkeypatch.setattr(tracking.Tracker, "_client", lambda self: client)
    tracker = tracking.Tracker("http://nowhere", "e", "run-1")
    tracker.record("start", 0, {})
    tracker.params({"train.lr": 0.1})
    tracker.record("eval", 10, {"accuracy": 0.5, "metrics": ["accuracy", "loss"]})
    for step in (20, 30, 40):
        tracker.record("eval", step, {"accuracy": step / 100, "metrics": ["accuracy", "loss"]})
    tracker.record("end", 50, {"accuracy": 0.9, "seconds": 3.0, "metrics": ["accuracy", "loss"]})
    client.release.set()
    tracker.close("FINISHED", timeout=10)
    assert client.batches == [[("accuracy", s) for s in (10, 20, 30, 40, 50)]]  # one request
    assert client.ended == ["FINISHED"] and not tracker.failed


@pytest.mark.slow
@pytest.mark.parametrize("lost", ["experiments/create", "runs/create"])
def test_a_write_whose_answer_was_lost_is_tried_again_without_a_second_experiment_or_run(
    mlflow_server, lost, monkeypatch, caplog
):
    """MLflow's client sends a write again when its answer is lost (503): an experiment it finds
    made is the one (before: RESOURCE_ALREADY_EXISTS ended the tracking, the experiment left
    with no run), and a second run made with the run's tag is deleted (before: two runs, one
    RUNNING forever with no points)."""
    from mlflow import MlflowClient

    for key in tracking.HTTP_DEFAULTS:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    name = f"lost-{lost.split('/')[0]}"
    with first_write(mlflow_server, lose=lost) as uri:
        tracker = tracking.Tracker(uri, f"lost-answers-{lost.split('/')[0]}", name)
        tracker.record("start", 0, {})
        tracker.record("eval", 40, {"accuracy": 0.5})
        tracker.record("end", 80, {"accuracy": 0.75, "seconds": 9.0})
        tracker.close(timeout=120)
    assert not tracker.failed and not [r for r in caplog.records if "MLflow" in r.getMessage()], caplog.text

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name(f"lost-answers-{lost.split('/')[0]}")
    (run,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.`ps-compose.run_id` = '{name}'")
    assert run.info.status == "FINISHED"
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "accuracy")) == [
        (40, 0.5),
        (80, 0.75),
    ]


@pytest.mark.slow
def test_a_server_restarted_mid_run_gets_the_whole_run_after_it(tmp_path, monkeypatch, caplog):
    """`docker restart` of the server mid-run (before: one warning, then nothing more was sent:
    the run RUNNING forever with the points before the restart): the tracker tries again until
    it answers, and the run ends FINISHED with every point, one warning and one line on its
    return."""
    from mlflow import MlflowClient

    for key in tracking.HTTP_DEFAULTS:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    caplog.set_level("INFO", logger="app.tracking")
    root, port = tmp_path / "server", free_port()
    root.mkdir()
    with mlflow_testkit.serve(root, "127.0.0.1", port) as uri:
        tracker = tracking.Tracker(uri, "restarted", "restarted-1")
        tracker.record("start", 0, {})
        tracker.record("eval", 10, {"accuracy": 0.25})
        _wait(lambda: tracker.sent >= 2, "the first evaluation sent")
    tracker.record("eval", 20, {"accuracy": 0.5})  # the server is down
    _wait(lambda: tracker.unanswered, "the tracker finding the server down")
    tracker.record("eval", 30, {"accuracy": 0.625})
    with mlflow_testkit.serve(root, "127.0.0.1", port):
        tracker.record("end", 40, {"accuracy": 0.75, "seconds": 9.0})
        tracker.close(timeout=120)
        client = MlflowClient(uri)
        (run,) = client.search_runs(
            [client.get_experiment_by_name("restarted").experiment_id],
            filter_string="tags.`ps-compose.run_id` = 'restarted-1'",
        )
        curve = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "accuracy"))
    assert not tracker.failed and run.info.status == "FINISHED"
    assert curve == [(10, 0.25), (20, 0.5), (30, 0.625), (40, 0.75)]
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    said = [(level, m) for level, m in messages if "MLflow" in m and "MLflow run" not in m]  # not the run's address
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert "trying again until the run ends" in said[0][1] and "answers again" in said[1][1]


@pytest.mark.slow
def test_a_uri_with_a_password_is_never_printed_with_it(caplog):
    """Credentials in MLFLOW_TRACKING_URI (before: `MLflow tracking at http://alice:s3cr3t-pw@...
    failed`, in the PS's log)."""
    tracker = tracking.Tracker(f"http://alice:s3cr3t-pw@127.0.0.1:{free_port()}", "e", "secret-1")
    tracker.record("start", 0, {})
    _wait(lambda: tracker.unanswered, "the tracker finding nothing there")
    tracker.close(timeout=1)
    assert "s3cr3t" not in caplog.text and "http://***@127.0.0.1:" in caplog.text, caplog.text
    assert shown("see https://bob:pw@host/x and http://host/y") == "see https://***@host/x and http://host/y"


def test_two_runs_without_a_run_id_are_two_mlflow_runs():
    """(before: both named `unnamed`, the second's points and model landing in the first's)"""
    env = {tracking.URI_ENV: "http://127.0.0.1:1"}
    first, second = (tracking.Tracker.from_env(env, "") for _ in range(2))
    for tracker in (first, second):
        tracker.close(timeout=5)
    assert first.run_name.startswith("unnamed-") and second.run_name.startswith("unnamed-")
    assert first.run_name != second.run_name
    assert tracking.Tracker.from_env(env, "run-7").run_name == "run-7"


def test_an_answer_no_retry_can_change_ends_the_tracking_with_one_warning(monkeypatch, caplog):
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    client = _SlowClient()
    client.release.set()

    def refuse(run_id, metrics=(), params=()):
        raise MlflowException("Changing param values is not allowed", error_code=INVALID_PARAMETER_VALUE)

    client.log_batch = refuse
    monkeypatch.setattr(tracking.Tracker, "_client", lambda self: client)
    tracker = tracking.Tracker("http://nowhere", "e", "run-1")
    tracker.record("start", 0, {})
    tracker.params({"train.lr": 0.1})
    tracker.record("eval", 10, {"accuracy": 0.5})
    tracker.close("FINISHED", timeout=10)
    warnings = [r.getMessage() for r in caplog.records if "MLflow" in r.getMessage()]
    assert tracker.failed and len(warnings) == 1 and "the run goes on without it" in warnings[0], warnings


def _wait(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.1)


def test_the_run_address_is_the_hosts_where_the_ps_reaches_the_server_at_another():
    """The project's own server is http://mlflow:5000 inside its network and 127.0.0.1:<port> on
    the host (the render says both); a server the caller named is the same address for both."""
    own = {
        tracking.URI_ENV: "http://mlflow:5000",
        "PSC_MLFLOW_SERVER": "http://mlflow:5000",
        "PSC_MLFLOW_UI": "http://127.0.0.1:5123",
    }
    trackers = [
        tracking.Tracker.from_env(own, "run-1"),
        tracking.Tracker.from_env({**own, tracking.URI_ENV: "https://bob:pw@mlflow.example.com/"}, "run-2"),
    ]
    for tracker in trackers:
        tracker.close(timeout=0)
    assert trackers[0].ui == "http://127.0.0.1:5123"
    assert trackers[1].ui == "https://***@mlflow.example.com"


class _DeadClient(_SlowClient):
    """A server that stops answering after the run opened: every write is refused at the socket,
    as by a server that went down (the tracker tries again until the end)."""

    def log_batch(self, run_id, metrics=(), params=()):
        raise ConnectionRefusedError(111, "Connection refused")

    def set_terminated(self, run_id, status):
        raise ConnectionRefusedError(111, "Connection refused")


def test_what_a_server_that_went_down_did_not_take_is_kept_in_order_and_a_resumed_end_adds_to_it(
    monkeypatch, tmp_path, caplog
):
    """The run's records MLflow did not take by the end are kept on disk, in order, with the
    model's files (tracking_pending); a PS that restarted and ended again adds its own after them."""
    from app.training import tracking_pending

    monkeypatch.setattr(tracking, "RETRY_SECONDS", (0.05,))
    monkeypatch.setattr(tracking.Tracker, "_client", lambda self: _DeadClient())
    keep = tmp_path / "mlflow-pending" / "run-9"
    tracker = tracking.Tracker("http://user:pw@nowhere:5000", "e", "run-9", keep=keep)
    tracker.record("start", 0, {"run_id": "run-9"})
    tracker.params({"train.lr": 0.1})
    tracker.record("eval", 10, {"accuracy": 0.5, "metrics": ["accuracy"]})
    tracker.record("worker", 11, {"worker": "worker1", "loss": 1.5, "samples_per_s": 900.0})
    tracker.model({"MLmodel": b"flavors: {}", "data/model.pth": b"\x00\x01"}, "model")
    tracker.record("end", 20, {"accuracy": 0.9, "seconds": 3.0, "metrics": ["accuracy"]})
    with caplog.at_level("WARNING", logger="app.tracking"):
        tracker.close("FAILED", timeout=0.5)
    assert any(f"kept in {keep} for `ps-compose runs sync`" in r.getMessage() for r in caplog.records)
    about, records = tracking_pending.load(keep)
    assert about == {"experiment": "e", "run_name": "run-9", "server": "http://***@nowhere:5000"}
    # the parameters went out with the run's opening and were refused: everything from them on is kept
    assert [r["kind"] for r in records] == ["params", "eval", "worker", "model", "end", "close"]
    assert records[1]["step"] == 10 and records[1]["fields"]["accuracy"] == 0.5 and "time" in records[1]["fields"]
    assert records[3]["files"] == ["MLmodel", "data/model.pth"]
    assert (keep / "files" / "model" / "data" / "model.pth").read_bytes() == b"\x00\x01"

    again = tracking.Tracker("http://nowhere:5000", "e", "run-9", keep=keep)  # the PS restarted, resumed, ended
    again.record("start", 20, {"run_id": "run-9"})
    again.record("end", 30, {"accuracy": 0.95, "seconds": 4.0, "metrics": ["accuracy"]})
    again.close("FAILED", timeout=0.5)
    _, more = tracking_pending.load(keep)
    assert more[: len(records)] == records and [r["kind"] for r in more[len(records) :]][-2:] == ["end", "close"]
    assert (keep / "files" / "model" / "MLmodel").read_bytes() == b"flavors: {}"
