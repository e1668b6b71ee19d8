"""A state volume that fills up: the PS keeps the trained model until final.pt is written,
and a finished run is never trained again from an older checkpoint.

The volume's limit is the PS's own RLIMIT_FSIZE (set and lifted from outside with prlimit,
SIGXFSZ ignored: a write past it fails with EFBIG as a full disk fails with ENOSPC), so the
tests need no root. Each failed before its fix: the PS exited 1 with `final.pt not written`,
and started again it resumed the older checkpoint and waited --join_timeout for workers that
had finished, then exited 1 again (compose's on-failure restarted it for ever); a checkpoint
directory too small for two checkpoints said nothing at the start.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from app.checkpoint import files as checkpoint_files
from app.checkpoint.writer import Checkpointer
from app.config import parse
from app.ps.server import ParameterServer
from app.training.metrics import MetricsWriter, read

from app_testkit import REPO, app_env, finished, free_port, ps_server, push, start_app, wait_for

LIMIT = 256 * 1024  # the cnn's checkpoint takes ~0.6 MB; the logs and metrics of a short run fit
RUN = "full-run"


def _ignore_sigxfsz() -> None:  # the child: a write past RLIMIT_FSIZE fails (EFBIG) instead of killing it
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _args(tmp_path: Path, port: int) -> list[str]:
    return [
        "--world_size",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "--metrics_dir",
        str(tmp_path / "metrics"),
        "--checkpoint_dir",
        str(tmp_path / "checkpoints"),
        "--run_id",
        RUN,
        "--model",
        "cnn",
        "--dataset",
        "digits",
        "--batch_size",
        "32",
        "--lr",
        "0.1",
        "--momentum",
        "0.5",
        "--eval_every",
        "100000",
        "--rpc_timeout",
        "20",
        "--seed",
        "1",
        "--join_timeout",
        "120",
        "--checkpoint_every",
        "20",
        "--num_epochs",
        "4",
    ]


def _wait_until(what: str, check, procs: dict, timeout: float = 120) -> None:
    """Until `check()` holds (an event, not a sleep of a guessed length); fail if a process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        ended = {name: p.returncode for name, p in procs.items() if p.poll() is not None}
        assert "ps" not in ended, f"the PS ended ({ended}) before {what}"
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout} s")


def _records(path: Path, event: str) -> list[dict]:
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if r["event"] == event]


@pytest.mark.slow
@pytest.mark.parametrize("then", ["room-made", "stopped"])
def test_a_full_volume_at_the_end_keeps_the_model_until_it_is_written(tmp_path, then):
    """The volume fills after the first checkpoint: the PS holds the trained model and says
    so; room made, final.pt is written at the trained version and the PS exits 0. Stopped
    instead, it tries once more and exits 143; started again (restart: on-failure) it finds
    the workers ended and exits 0 at once, without training the run again from the older
    checkpoint."""
    args = _args(tmp_path, free_port())
    procs = {
        "ps": start_app(tmp_path, "ps", ["ps", *args], preexec_fn=_ignore_sigxfsz),
        "worker1": start_app(tmp_path, "worker1", ["worker", "--rank", "1", *args]),
    }
    ps_metrics = tmp_path / "metrics" / "ps.jsonl"
    err = tmp_path / "ps.err"
    try:
        _wait_until("first checkpoint", lambda: _records(ps_metrics, "checkpoint"), procs)
        resource.prlimit(procs["ps"].pid, resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))  # the volume fills
        _wait_until("'final.pt not written'", lambda: "final.pt not written" in err.read_text(), procs, 240)
        assert procs["ps"].poll() is None  # was: exit 1, the model gone with the process
        if then == "room-made":
            resource.prlimit(procs["ps"].pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        else:
            procs["ps"].send_signal(signal.SIGTERM)
    finally:
        wait_for(procs, 120, "the cluster")
    ps, worker = finished(tmp_path, "ps", procs["ps"]), finished(tmp_path, "worker1", procs["worker1"])
    assert worker.returncode == 0, worker.stderr
    held = [line for line in ps.stderr.splitlines() if "final.pt not written" in line]
    assert "the model trained to version" in held[0] and "is kept in memory" in held[0], ps.stderr
    on_disk = [checkpoint_files.verify(p)["version"] for p in checkpoint_files.listing(tmp_path / "checkpoints")]
    if then == "room-made":
        assert ps.returncode == 0, ps.stderr
        end = _records(ps_metrics, "end")[-1]
        final = torch.load(tmp_path / "checkpoints" / "final.pt", weights_only=True)
        assert final["version"] == end["step"] and final["run_id"] == RUN
        assert final["version"] > min(on_disk)  # the trained model, not the checkpoint before the volume filled
        return
    assert ps.returncode == 128 + signal.SIGTERM, ps.stderr
    assert "stopped (SIGTERM) with final.pt still not written" in ps.stderr, ps.stderr
    assert not (tmp_path / "checkpoints" / "final.pt").exists()
    again = {"ps": start_app(tmp_path, "ps-again", ["ps", *args])}  # compose restarts it
    wait_for(again, 60, "the restarted PS")  # was: resumed the older checkpoint, waited join_timeout, exit 1
    restarted = finished(tmp_path, "ps", again["ps"], "ps-again")
    assert restarted.returncode == 0, restarted.stderr
    assert f"run {RUN} already ended: worker1 finished or left" in restarted.stderr, restarted.stderr
    assert not (tmp_path / "checkpoints" / "final.pt").exists()
    assert [checkpoint_files.verify(p)["version"] for p in checkpoint_files.listing(tmp_path / "checkpoints")] == (
        on_disk
    )  # nothing trained, nothing written


# --- final.pt alone ends its run; the room check at the start --------------------------


def _checkpointer(tmp_path: Path, run_id: str, **flags: str) -> tuple[ParameterServer, Checkpointer, MetricsWriter]:
    server = ps_server(nn.Linear(2, 2), lr=0.1, momentum=0.0, num_trainers=1)
    server.join(1, "worker1")
    argv = ["ps", "--checkpoint_dir", str(tmp_path / "ck"), "--run_id", run_id, "--checkpoint_every", "0"]
    for flag, value in flags.items():
        argv += [f"--{flag}", value]
    metrics = MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0)
    return server, Checkpointer(server, parse(argv, {}), {"trainer": "ps"}, metrics), metrics


def test_a_run_whose_final_pt_was_written_is_finished_though_its_newest_checkpoint_is_older(tmp_path):
    """final.pt written, the checkpoint marked finished after it not (the volume full): a
    restart of that run has nothing to do (it resumed the older checkpoint), and --resume of
    a new run does not continue it (it did)."""
    server, ck, m = _checkpointer(tmp_path, "runA")
    ck.resume()
    for step in range(3):
        push(server, 1, torch.ones(6), step)
    ck.save("every 3 updates")  # version 3 on disk
    push(server, 1, torch.ones(6), 3)
    server.finish(1, 4, "worker1")
    checkpoint_files.save_atomically({**ck._state(), "finished": True}, tmp_path / "ck" / "final.pt")  # noqa: SLF001
    m.close()
    assert checkpoint_files.newest_good(tmp_path / "ck")[1]["version"] == 3
    server, ck, m = _checkpointer(tmp_path, "runA")  # the same run's PS, restarted
    ck.resume()
    m.close()
    assert ck.run_finished.startswith("run runA already finished at version 4 (final.pt;"), ck.run_finished
    assert server.version == 0
    server, ck, m = _checkpointer(tmp_path, "runB", resume="true")
    ck.resume()
    m.close()
    assert server.version == 0 and not ck.run_finished  # a new run at version 0; run A set aside whole
    assert (tmp_path / "ck" / "previous" / "runA" / "final.pt").is_file()


ROOM = """
import logging, resource, signal, sys
from torch import nn
from app.checkpoint.writer import Checkpointer
from app.training.metrics import MetricsWriter
from app.config import parse
from app.ps.members.members import MembersConfig
from app.ps.server import ParameterServer, ServerConfig
from app.ps.state import StateConfig
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[2])
if limit:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
server = ParameterServer(nn.Linear(300, 300), ServerConfig(StateConfig(lr=0.1, momentum=0.9), MembersConfig(1)))
config = parse(["ps", "--checkpoint_dir", sys.argv[1] + "/ck", "--run_id", "r", "--momentum", "0.9"], {})
with MetricsWriter(sys.argv[1] + "/m", "ps", "ps", 0) as metrics:
    Checkpointer(server, config, {"trainer": "ps"}, metrics).resume()
"""


@pytest.mark.parametrize("limit", [0, 500_000])
def test_room_for_fewer_than_two_checkpoints_is_a_warning_at_the_start(tmp_path, limit):
    """A 300x300 linear layer with momentum: about 0.72 MB a checkpoint. Files limited to
    0.48 MB: one line at the start (there was none); no limit: none."""
    r = subprocess.run(
        [sys.executable, "-c", ROOM, str(tmp_path), str(limit)],
        capture_output=True,
        text=True,
        env=app_env(),
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stdout.splitlines() if "room for fewer than two checkpoints" in line]
    if not limit:
        assert warnings == [], r.stdout
        return
    assert len(warnings) == 1, r.stdout
    assert f"--checkpoint_dir {tmp_path / 'ck'}:" in warnings[0]
    assert "files are limited to 0.48 MB (ulimit -f)" in warnings[0] and "checkpoints of about 0.69 MB" in warnings[0]


METRICS = """
import logging, resource, signal, sys
from app.training.metrics import MetricsWriter
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
with MetricsWriter(sys.argv[1], "ps", "ps", 0) as metrics:
    metrics.write("eval", 1, accuracy=0.5)
    resource.setrlimit(resource.RLIMIT_FSIZE, (150, resource.RLIM_INFINITY))  # the volume fills
    for step in range(2, 6):
        metrics.write("eval", step, accuracy=0.5, note="x" * 20)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    metrics.write("end", 6, accuracy=0.9)
print("went on")
"""


def test_metrics_that_do_not_fit_are_dropped_whole_and_the_process_goes_on(tmp_path):
    """A record past the room was an OSError out of the PS's metrics writer (the PS failed,
    its model with it), after half a line written."""
    r = subprocess.run(
        [sys.executable, "-c", METRICS, str(tmp_path)],
        capture_output=True,
        text=True,
        env=app_env(),
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0 and "went on" in r.stdout, r.stdout + r.stderr
    records = read(tmp_path / "ps.jsonl")  # every line whole JSON
    assert [rec["step"] for rec in records] == [1, 6]
    warnings = [line for line in r.stdout.splitlines() if line.startswith("WARNING metrics:")]
    assert len(warnings) == 2 and "dropping records until it fits" in warnings[0], r.stdout
    assert warnings[1].endswith("again; 4 record(s) were dropped"), r.stdout
