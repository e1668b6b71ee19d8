"""TensorBoard event files beside the JSON lines: read back with TensorBoard's own reader
(EventAccumulator), every scalar equal to its JSONL record, one point per step after a resume,
and the JSON lines alone when the writer cannot be imported."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.config import parse
from app.contract import TENSORBOARD_DIR, event_dir
from app.training.metrics import MetricsWriter, read

from app_testkit import (
    REPO,
    app_env,
    assert_same_curves,
    curves,
    digits,
    expected_curves,
    finished,
    free_port,
    start_app,
    wait_for,
)


def _config(run_id: str, name: str = "worker1"):
    return parse(["worker", "--rank", name.removeprefix("worker"), "--run_id", run_id], {})


def test_each_record_is_written_once_and_both_sinks_have_it(tmp_path):
    config = _config("run-1")
    with MetricsWriter(str(tmp_path), "worker1", "worker", 1) as metrics:
        metrics.start(config, 0)
        for step in range(1, 6):
            metrics.write(
                "train",
                step,
                epoch=1,
                batch=step,
                loss=2.0 / step,
                samples_per_s=100.0 + step,
                step_seconds=0.01 * step,
                staleness=step % 2,
                lead=0,
            )
        metrics.write("checkpoint", 5, file="ckpt", why="test", seconds=0.1)  # no numbers for TensorBoard
        metrics.write("end", 5, seconds=1.0)
    records = read(tmp_path / "worker1.jsonl")
    assert [r["event"] for r in records] == ["start"] + ["train"] * 5 + ["checkpoint", "end"]
    got = curves(event_dir(str(tmp_path), "run-1", "worker1"))
    assert sorted(got) == ["train/loss", "train/samples_per_s", "train/staleness", "train/step_seconds"]
    assert_same_curves(got, expected_curves(records), "worker1")


def test_a_process_started_again_continues_its_curves_without_a_step_twice(tmp_path):
    """The first process wrote steps 1..8; the second resumed at step 5 (its checkpoint) and
    writes 6..10: TensorBoard shows 1..10 once each, 6..8 with the second process's values."""
    for first, steps, loss in ((0, range(1, 9), 1.0), (5, range(6, 11), 3.0)):
        with MetricsWriter(str(tmp_path), "ps", "ps", 0) as metrics:
            metrics.start(_config("run-1"), first)
            for step in steps:
                metrics.write("eval", step, accuracy=step / 10, loss=loss, samples=step * 32)
        time.sleep(1.1)  # event files are named by the second they were opened in
    got = curves(event_dir(str(tmp_path), "run-1", "ps"))
    assert [s for s, _ in got["eval/loss"]] == list(range(1, 11))
    assert [v for _, v in got["eval/loss"]] == [1.0] * 5 + [3.0] * 5
    assert_same_curves(got, expected_curves(read(tmp_path / "ps.jsonl")), "ps")


def test_runs_and_processes_get_directories_of_their_own(tmp_path):
    for run_id in ("run-a", "run-b"):
        for name in ("ps", "worker1"):
            with MetricsWriter(str(tmp_path), name, "ps", 0) as metrics:
                metrics.start(_config(run_id), 0)
                metrics.write("eval", 1, accuracy=0.5, loss=1.0)
    root = tmp_path / TENSORBOARD_DIR
    assert sorted(str(p.relative_to(root)) for p in root.glob("*/*")) == [
        "run-a/ps",
        "run-a/worker1",
        "run-b/ps",
        "run-b/worker1",
    ]


def test_without_tensorboard_the_app_writes_the_json_lines_alone(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails
    with caplog.at_level(logging.WARNING), MetricsWriter(str(tmp_path), "ps", "ps", 0) as metrics:
        metrics.start(_config("run-1"), 0)
        metrics.write("eval", 1, accuracy=0.5, loss=1.0)
    assert [r["event"] for r in read(tmp_path / "ps.jsonl")] == ["start", "eval"]
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("no TensorBoard event files (") and "JSON lines only" in warning


FILLS_UP = """
import logging, resource, signal, sys, threading, time
from pathlib import Path
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from app.config import parse
from app.training import event_files
from app.training.metrics import MetricsWriter

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails (EFBIG), as a full disk does
event_files.FLUSH_SECONDS, event_files.RETRY_SECONDS = 0.2, 0.0
failed = threading.Event()


class Seen(logging.Handler):
    def emit(self, record):
        if record.name == "app.training.event_files" and "not written" in record.getMessage():
            failed.set()


logging.getLogger("app.training.event_files").addHandler(Seen())
directory = Path(sys.argv[1])
with MetricsWriter(str(directory), "worker1", "worker", 1) as metrics:
    metrics.start(parse(["worker", "--rank", "1", "--run_id", "full"], {}), 0)
    metrics.write("train", 1, loss=1.0)
    events = next((directory / "tensorboard").rglob("events.out.*"))
    while not EventAccumulator(str(events.parent)).Reload().Tags()["scalars"]:  # the first point is on disk
        time.sleep(0.05)
    resource.setrlimit(resource.RLIMIT_FSIZE, (events.stat().st_size, resource.RLIM_INFINITY))  # the volume fills
    step, deadline = 2, time.monotonic() + 120
    while not failed.is_set() and time.monotonic() < deadline:  # until the writer's thread meets it
        metrics.write("train", step, loss=1.0 / step)
        step += 1
        time.sleep(0.02)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # room made
    metrics.write("end", step, accuracy=0.9)
print("went on", step)
"""


def test_event_files_that_do_not_fit_are_one_warning_and_start_again_when_there_is_room(tmp_path):
    """A full volume under the event files: TensorBoard's writer thread died with a traceback
    and the next scalar raised its OSError out of the worker (`worker1 failed: OSError: [Errno
    28]`, exit 1). Now one warning, the process goes on, and once room is made the scalars
    after it reach TensorBoard again in a new event file."""
    r = subprocess.run(
        [sys.executable, "-c", FILLS_UP, str(tmp_path)],
        capture_output=True,
        text=True,
        env=app_env(),
        cwd=REPO,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "went on" in r.stdout, out
    assert "Traceback" not in out and "Exception in thread" not in out, out
    said = [line for line in r.stdout.splitlines() if line.startswith("WARNING app.training.event_files")]
    assert len(said) == 1 and "not written (File too large): scalars are dropped until there is room" in said[0], out
    last = int(r.stdout.split("went on ")[1])
    got = curves(event_dir(str(tmp_path), "full", "worker1"))
    assert got["train/loss"][0] == (1, 1.0) and got["end/accuracy"] == [(last, pytest.approx(0.9))], got


# --- real processes: a PS run, killed and resumed within its run ------------------

DIGITS = digits(
    lr=0.1,
    seed=1,
    eval_every=10,
    checkpoint_every=30,
    log_every=2,
    rpc_timeout=30,
    join_timeout=120,
    master_addr="127.0.0.1",
    world_size=3,
    num_epochs=4,
)
NAMES = ("ps", "worker1", "worker2")


def _start_job(tmp_path: Path, tag: str, port: int) -> dict:
    common = [
        *DIGITS,
        "--master_port",
        str(port),
        "--run_id",
        "run-1",
        "--metrics_dir",
        str(tmp_path / "metrics"),
        "--checkpoint_dir",
        str(tmp_path / "checkpoints"),
    ]
    procs = {"ps": start_app(tmp_path, f"ps{tag}", ["ps", *common])}
    for rank in (1, 2):
        procs[f"worker{rank}"] = start_app(tmp_path, f"worker{rank}{tag}", ["worker", "--rank", str(rank), *common])
    return procs


def _records(tmp_path: Path, name: str, event: str) -> list[dict]:
    path = tmp_path / "metrics" / f"{name}.jsonl"
    return [r for r in read(path) if r["event"] == event] if path.exists() else []


@pytest.mark.slow
def test_a_ps_run_killed_and_resumed_has_every_record_in_tensorboard_once(tmp_path):
    """PS and two workers on digits; the PS is killed (no checkpoint on exit) once it has
    evaluated past its last checkpoint, every process is started again in the same run: the
    PS resumes that checkpoint and evaluates those versions again. TensorBoard's reader
    shows every tag of every process with one point per step, each the JSONL record's value."""
    procs = _start_job(tmp_path, "", free_port())
    deadline = time.monotonic() + 240
    try:
        while True:
            saved = [r["step"] for r in _records(tmp_path, "ps", "checkpoint")]
            if saved and any(r["step"] > saved[-1] for r in _records(tmp_path, "ps", "eval")):
                break
            assert all(p.poll() is None for p in procs.values()), "a process ended before the kill"
            assert time.monotonic() < deadline, "no evaluation past a checkpoint within 240 s"
            time.sleep(0.1)
        for p in procs.values():
            p.send_signal(signal.SIGKILL)
    finally:
        wait_for(procs, 30, "the killed run")
    before = [r["step"] for r in _records(tmp_path, "ps", "eval")]
    procs = _start_job(tmp_path, "-again", free_port())
    wait_for(procs, 240, "the resumed run")
    for name, proc in procs.items():
        p = finished(tmp_path, name, proc, f"{name}-again")
        assert p.returncode == 0, f"{name} exited {p.returncode}:\n{p.stderr}"
    # the resumed PS went back to its checkpoint, before its last evaluation: the job trained
    # those versions again, and its processes wrote records at steps they had written before
    [resumed] = [r["step"] for r in _records(tmp_path, "ps", "resume")]
    assert resumed < before[-1], (resumed, before)
    steps = {name: [r["step"] for r in read(tmp_path / "metrics" / f"{name}.jsonl")] for name in NAMES}
    assert any(len(s) > len(set(s)) for s in steps.values()), f"no step written twice: {steps}"
    for name in NAMES:
        records = read(tmp_path / "metrics" / f"{name}.jsonl")
        got = curves(event_dir(str(tmp_path / "metrics"), "run-1", name))
        assert_same_curves(got, expected_curves(records), name)
    ps = curves(event_dir(str(tmp_path / "metrics"), "run-1", "ps"))
    assert {
        "eval/accuracy",
        "eval/updates_per_s",
        "eval/samples_per_s",
        "eval/staleness",
        "eval/workers",
        "end/accuracy",
    } <= set(ps)
    assert ps["eval/accuracy"][-1][1] > 0.5


def test_the_runs_settings_and_its_final_metrics_are_in_the_hparams_tab(tmp_path):
    """TensorBoard's HPARAMS tab: the start record's settings beside the end record's metrics."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    config = parse(["ps", "--run_id", "run-h", "--strategy", "diloco", "--batch_size", "16"], {})
    with MetricsWriter(str(tmp_path), "ps", "ps", 0) as metrics:
        metrics.start(config, 0)
        metrics.write("end", 7, accuracy=0.93, loss=0.25, metrics=["accuracy", "loss"], seconds=1.0)
    events = EventAccumulator(event_dir(str(tmp_path), "run-h", "ps"))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = {k: v.string_value or v.number_value for k, v in session.session_start_info.hparams.items()}
    assert hparams["strategy"] == "diloco" and hparams["batch_size"] == 16 and hparams["model"] == config.model
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    assert {m.name.tag for m in experiment.experiment.metric_infos} == {"end/accuracy", "end/loss"}
    assert events.Scalars("end/accuracy")[0].value == pytest.approx(0.93)
