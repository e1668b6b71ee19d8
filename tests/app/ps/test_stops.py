"""What a stop keeps: a sharded PS's slices on SIGTERM, a finished run restarted, a run
stopped before it applied anything, a checkpoint directory it cannot write to (or create).

Each test failed before its fix: a sharded PS stopped by SIGTERM wrote no checkpoint at
all; a finished run's PS, restarted, set final.pt aside and trained again; a run stopped
before any push wrote a version-0 checkpoint that --resume then continued instead of the
run it had set aside; a read-only checkpoint directory was found out after the whole run, and
one still to be created under a read-only parent was an OSError (exit 1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from app.checkpoint import files as checkpoint_files
from app.checkpoint.writer import Checkpointer
from app.config import UsageError, parse
from app.ps.server import ParameterServer
from app.training.metrics import MetricsWriter

from app_testkit import digits, finished, free_port, ps_server, push, run_app, start_app, wait_for

DIGITS = digits(lr=0.1, momentum=0.5, eval_every=100000, rpc_timeout=60, seed=1, join_timeout=60)


def _server() -> ParameterServer:
    server = ps_server(nn.Linear(2, 2), lr=0.1, momentum=0.0, num_trainers=1)
    server.join(1, "worker1")
    return server


def _config(tmp_path: Path, run_id: str, **kw) -> object:
    base = parse(["ps", "--checkpoint_dir", str(tmp_path / "ck"), "--run_id", run_id, "--checkpoint_every", "0"], {})
    return dataclasses.replace(base, **kw)


def _checkpointer(tmp_path: Path, run_id: str, **kw) -> tuple[ParameterServer, Checkpointer, MetricsWriter]:
    server = _server()
    metrics = MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0)
    return server, Checkpointer(server, _config(tmp_path, run_id, **kw), {"trainer": "ps"}, metrics), metrics


# --- a run that applied nothing, and --resume -------------------------------------------


def test_a_run_stopped_before_any_push_writes_nothing_and_resume_continues_the_run_it_set_aside(tmp_path):
    server, ck, m = _checkpointer(tmp_path, "runA")
    ck.resume()
    for step in range(3):
        push(server, 1, torch.ones(6), step)
    ck.save("on exit", on_exit=True)
    m.close()
    server, ck, m = _checkpointer(tmp_path, "runB")  # a new run: A is set aside
    ck.resume()
    assert server.version == 0 and checkpoint_files.listing(tmp_path / "ck") == []
    ck.save("on exit", on_exit=True)  # stopped before any push
    m.close()
    assert checkpoint_files.listing(tmp_path / "ck") == []  # was: ckpt-00000000 of run B
    server, ck, m = _checkpointer(tmp_path, "runC", resume=True)
    ck.resume()
    m.close()
    assert server.version == 3  # run A's 3 updates, moved back from previous/
    assert checkpoint_files.verify(checkpoint_files.listing(tmp_path / "ck")[0])["run_id"] == "runA"


def _checkpoint_records(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "m" / "ps.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "checkpoint"]


def test_a_stop_at_the_version_just_checkpointed_writes_nothing_and_names_the_file_that_holds_it(tmp_path):
    server, ck, m = _checkpointer(tmp_path, "runA")
    ck.resume()
    for step in range(3):
        push(server, 1, torch.ones(6), step)
    ck.save("every 3 updates")
    ck.save("on exit", on_exit=True)  # the last push was checkpointed already
    m.close()

    files = checkpoint_files.listing(tmp_path / "ck")
    periodic, on_exit = _checkpoint_records(tmp_path)
    assert len(files) == 1 and periodic["file"] == files[0].name and "written" not in periodic
    assert on_exit["why"] == "on exit" and on_exit["written"] is False
    assert (on_exit["step"], on_exit["file"]) == (3, files[0].name)


def test_a_stop_right_after_a_resume_names_the_checkpoint_it_resumed_from(tmp_path):
    server, ck, m = _checkpointer(tmp_path, "runA")
    ck.resume()
    push(server, 1, torch.ones(6), 0)
    ck.save("on exit", on_exit=True)
    m.close()
    server, ck, m = _checkpointer(tmp_path, "runA")  # the same run, restarted, stopped before any push
    ck.resume()
    ck.save("on exit", on_exit=True)
    m.close()

    files = checkpoint_files.listing(tmp_path / "ck")
    records = _checkpoint_records(tmp_path)
    assert len(files) == 1 and [r.get("written", True) for r in records] == [True, False]
    assert records[-1]["step"] == 1 and records[-1]["file"] == files[0].name


def test_a_finished_run_restarted_has_nothing_to_do_and_keeps_its_final_pt(tmp_path):
    server, ck, m = _checkpointer(tmp_path, "runA")
    ck.resume()
    push(server, 1, torch.ones(6), 0)
    server.finish(1, 1, "worker1")  # every worker finished: the checkpoint final() writes says so
    ck.final()
    m.close()
    final = tmp_path / "ck" / "final.pt"
    before = (final.read_bytes(), final.stat().st_mtime_ns)
    server, ck, m = _checkpointer(tmp_path, "runA")  # the same run's PS, restarted
    ck.resume()
    m.close()
    assert ck.run_finished.startswith("run runA already finished at version 1")
    assert (final.read_bytes(), final.stat().st_mtime_ns) == before
    assert not (tmp_path / "ck" / "previous").exists()
    server, ck, m = _checkpointer(tmp_path, "runB")  # another run: starts fresh, sets it aside
    ck.resume()
    m.close()
    assert not ck.run_finished and server.version == 0 and (tmp_path / "ck" / "previous" / "runA").is_dir()


# --- a checkpoint directory that cannot be written ---------------------------------------


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write to: a read-only bind mount (root ignores file
    modes), or mode 0555."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = False
    if os.geteuid() == 0:
        mounted = (
            subprocess.run(["mount", "--bind", str(ro), str(ro)], capture_output=True).returncode == 0
            and subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True).returncode == 0
        )
    else:
        ro.chmod(0o555)
    try:
        probe = ro / "probe"
        try:
            probe.write_bytes(b"")
            pytest.fail("cannot make a read-only directory here (root without mount)")
        except OSError:
            pass
        yield ro
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], capture_output=True)
        ro.chmod(0o755)


# "missing": a directory that does not exist yet under a read-only parent (it was an
# OSError from mkdir: exit 1 with a traceback's last line, not the one line and exit 2).
WHERE = {"existing": "", "missing": "ck"}


@pytest.mark.parametrize("where", WHERE)
def test_a_read_only_checkpoint_directory_is_refused_at_the_start(tmp_path, read_only_dir, where):
    directory = read_only_dir / WHERE[where]
    server, ck, m = _checkpointer(tmp_path, "runA", checkpoint_dir=str(directory))
    with pytest.raises(UsageError, match=f"^--checkpoint_dir {directory}: cannot write there \\(Read-only"):
        ck.resume()
    m.close()


@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
def test_the_ps_with_a_read_only_checkpoint_directory_exits_2_with_one_line(read_only_dir, where):
    directory = read_only_dir / WHERE[where]
    r = run_app(
        "ps",
        "--world_size",
        "2",
        "--master_port",
        str(free_port()),
        "--checkpoint_dir",
        str(directory),
        "--metrics_dir",
        str(read_only_dir.parent / "m"),
        *DIGITS,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and f"--checkpoint_dir {directory}: cannot write there" in errors[0], r.stderr


# --- real processes: a finished run's PS restarted; a sharded PS stopped -------------------


def _common(tmp_path: Path, port: int, workers: int, run_id: str) -> list[str]:
    return [
        "--world_size",
        str(workers + 1),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "--metrics_dir",
        str(tmp_path / "metrics"),
        "--checkpoint_dir",
        str(tmp_path / "checkpoints"),
        "--run_id",
        run_id,
        *DIGITS,
    ]


@pytest.mark.slow
def test_a_finished_runs_ps_started_again_exits_0_at_once_and_leaves_final_pt(tmp_path):
    common = _common(tmp_path, free_port(), 1, "done-run") + ["--num_epochs", "1"]
    procs = {
        "ps": start_app(tmp_path, "ps", ["ps", *common]),
        "worker1": start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common]),
    }
    wait_for(procs, 180)
    assert all(p.returncode == 0 for p in procs.values())
    final = tmp_path / "checkpoints" / "final.pt"
    before = (final.read_bytes(), final.stat().st_mtime_ns)
    again = {"ps": start_app(tmp_path, "ps-again", ["ps", *common])}  # restart: on-failure, same run id
    wait_for(again, 60, "the restarted PS")  # was: trained again, then join_timeout, exit 1
    ps = finished(tmp_path, "ps", again["ps"], "ps-again")
    assert ps.returncode == 0, ps.stderr
    assert "run done-run already finished" in ps.stderr + ps.stdout
    assert (final.read_bytes(), final.stat().st_mtime_ns) == before
    assert not (tmp_path / "checkpoints" / "previous").exists()


def _wait_for_steps(path: Path, steps: int, procs: dict, timeout: float = 120) -> None:
    """Until the metrics file shows `steps` pushes (an event, not a sleep of a guessed length)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if any(r.get("step", 0) >= steps for r in records):
                return
        assert all(p.poll() is None for p in procs.values()), "a process ended early"
        time.sleep(0.2)
    pytest.fail(f"{path.name} did not reach step {steps}")


def _stop(procs: dict, names: list[str]) -> None:
    for name in names:
        procs[name].send_signal(signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["shards-first", "all-at-once"])
def test_a_sharded_ps_stopped_keeps_every_slice_and_resumes(tmp_path, order):
    """`make down` stops the shards before the PS; a host shutdown stops them together.
    Either way every slice is written with the run id, and the restarted job continues."""
    port = free_port()
    common = _common(tmp_path, port, 2, "sharded-run") + ["--shards", "2", "--checkpoint_every", "0"]
    roles = {
        "ps": ["ps"],
        "ps1": ["ps", "--shard", "1"],
        "worker1": ["worker", "--rank", "1"],
        "worker2": ["worker", "--rank", "2"],
    }
    procs = {name: start_app(tmp_path, name, [*role, *common, "--num_epochs", "40"]) for name, role in roles.items()}
    try:
        _wait_for_steps(tmp_path / "metrics" / "worker1.jsonl", 20, procs)
        if order == "shards-first":
            _stop(procs, ["ps1"])
            procs["ps1"].wait(timeout=60)
            _stop(procs, ["ps"])
        else:
            _stop(procs, ["ps", "ps1"])
        _stop(procs, ["worker1", "worker2"])
    finally:
        wait_for(procs, 90, "the stopped cluster")
    main = [checkpoint_files.verify(p) for p in checkpoint_files.listing(tmp_path / "checkpoints")]
    slices = [checkpoint_files.verify(p) for p in checkpoint_files.listing(tmp_path / "checkpoints" / "shard1")]
    assert main and main[0]["version"] > 0 and main[0]["run_id"] == "sharded-run", finished(
        tmp_path, "ps", procs["ps"]
    ).stderr
    assert slices and slices[0]["version"] > 0 and slices[0]["run_id"] == "sharded-run", finished(
        tmp_path, "ps1", procs["ps1"]
    ).stderr
    stopped_at = main[0]["version"]

    again = {
        name: start_app(tmp_path, f"{name}-2", [*role, *common, "--num_epochs", "2"]) for name, role in roles.items()
    }
    wait_for(again, 240, "the restarted cluster")
    done = {name: finished(tmp_path, name, p, f"{name}-2") for name, p in again.items()}
    assert {n: p.returncode for n, p in done.items()} == dict.fromkeys(roles, 0), {
        n: p.stderr[-800:] for n, p in done.items()
    }
    assert f"version {stopped_at}" in done["ps"].stderr, done["ps"].stderr
    assert "resumed from ckpt-" in done["ps1"].stderr, done["ps1"].stderr
    assert (tmp_path / "checkpoints" / "final.pt").is_file()
