"""A run never inherits another run's state by accident: run ids in checkpoints, a new run
starting fresh (older files set aside, never deleted), --resume, and which ranks count as
finished after a resume. Roster and checkpointer here; real RPC processes at the end."""

from __future__ import annotations

import logging
import re
import shutil
import signal
import time

import pytest
import torch

from app.checkpoint import files as checkpoint_files
from app.checkpoint.writer import Checkpointer
from app.config import UsageError, parse
from app.ps.members.roster import ABSENT, FINISHED, LIVE, Roster
from app.ps.server import ParameterServer
from app.training import models
from app.training.metrics import MetricsWriter, read

from app_testkit import digits, finished, free_port, ps_server, push, start_app, wait_for

IDENTITY = {"model_name": "cnn", "trainer": "ps"}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --- the roster: who counts as finished ------------------------------------


def _finished_in_a_checkpoint(*ranks: int) -> dict[int, dict[str, int]]:
    """Progress of ranks 1..4 in which `ranks` finished (epoch 2 done) and the others never ran."""
    roster = Roster([1, 2, 3, 4], join_timeout=30, clock=Clock())
    for rank in ranks:
        roster.join(rank, f"worker{rank}")
        roster.record_push(rank, epoch=2, batch=20)
        roster.finish(rank, f"worker{rank}")
    return roster.state()


def test_a_rank_that_joins_again_after_finishing_is_live_not_finished():
    roster = Roster([1, 2], join_timeout=30, clock=Clock())
    roster.join(1, "worker1")
    roster.finish(1, "worker1")
    assert roster.join(1, "worker1_r2").state == LIVE
    assert roster.counts() == "1 live, 0 finished of 2"


def test_a_push_from_a_finished_rank_makes_it_live():
    roster = Roster([1], join_timeout=30, clock=Clock())
    roster.restore({1: {"epoch": 2, "batch": 20, "pushes": 1, "finished": 1}})
    assert roster[1].state == FINISHED and roster.all_finished
    assert roster.seen(1, "worker1_r2") is True
    assert roster[1].state == LIVE and roster[1].name == "worker1_r2" and not roster.done()


def test_a_checkpoint_of_this_run_keeps_its_finished_ranks():
    roster = Roster([1, 2, 3, 4], join_timeout=30, clock=Clock())
    roster.restore(_finished_in_a_checkpoint(2, 4), same_run=True)
    assert [roster[r].state for r in (1, 2, 3, 4)] == [ABSENT, FINISHED, ABSENT, FINISHED]


def test_a_checkpoint_of_another_run_restores_progress_but_no_finish():
    roster = Roster([1, 2, 3, 4], join_timeout=30, clock=Clock())
    roster.restore(_finished_in_a_checkpoint(2, 4), same_run=False)
    assert all(m.state == ABSENT for m in roster.members.values())
    assert roster[2].progress()._asdict() == {"epoch": 2, "batch": 20, "pushes": 1}


@pytest.mark.parametrize("same_run", [True, False])
def test_the_job_does_not_end_while_rejoined_finished_ranks_train(same_run):
    """The defect: ranks 2 and 4 recorded as finished, resumed; they rejoin and train, ranks
    1 and 3 finish: the PS used to count "4 finished of 4" and end under them."""
    clock = Clock()
    roster = Roster([1, 2, 3, 4], join_timeout=30, clock=clock)
    roster.restore(_finished_in_a_checkpoint(2, 4), same_run=same_run)
    for rank in (1, 2, 3, 4):
        roster.join(rank, f"worker{rank}_r2" if rank in (2, 4) else f"worker{rank}")
    for rank in (1, 3):
        roster.finish(rank, f"worker{rank}")
    clock.now = 1000  # long past join_timeout: it must not matter for live ranks
    assert not roster.done() and roster.counts() == "2 live, 2 finished of 4"
    for rank in (2, 4):
        roster.finish(rank, f"worker{rank}_r2")
    assert roster.done() and roster.all_finished


# --- checkpoints of runs -----------------------------------------------------


def _server(run_id: str = "") -> ParameterServer:
    return ps_server(models.build("cnn", 1, 10, seed=0), lr=0.1, momentum=0.9, num_trainers=2, run_id=run_id)


def _run(tmp_path, run_id: str, pushes: int, *extra: str, finish: bool = False) -> Checkpointer:
    """One PS run's checkpointer on tmp_path/ck after `pushes` updates and a checkpoint."""
    config = parse(["ps", "--checkpoint_dir", str(tmp_path / "ck"), "--run_id", run_id, *extra], {})
    server = _server(config.run_id)
    with MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0) as metrics:
        saver = Checkpointer(server, config, IDENTITY, metrics)
        saver.resume()
        server.join(1, "worker1")
        for _ in range(pushes):
            message = torch.ones(server.state.size)
            push(server, 1, message, server.version, "worker1", epoch=1, batch=server.version + 1)
        if finish:
            server.finish(1, 0, "worker1")
            server.join(2, "worker2")
            server.finish(2, 0, "worker2")
            saver.final()
        elif pushes:
            saver.save("test")
    return saver


def test_a_new_run_starts_fresh_and_sets_an_unfinished_runs_files_aside(tmp_path, caplog):
    _run(tmp_path, "run-a", 3)
    old = {p.name: p.read_bytes() for p in (tmp_path / "ck").glob("ckpt-*.pt")}
    with caplog.at_level(logging.INFO, logger="app.checkpoint"):
        fresh = _run(tmp_path, "run-b", 0)
    assert fresh.server.version == 0 and fresh.saved_version == -1
    aside = tmp_path / "ck" / checkpoint_files.PREVIOUS / "run-a"
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == old  # moved whole, nothing deleted
    assert checkpoint_files.listing(tmp_path / "ck") == []
    [line] = [r.getMessage() for r in caplog.records if "not resuming" in r.getMessage()]
    assert re.fullmatch(
        r"not resuming from ckpt-00000003-[0-9a-f]{16}\.pt \(version 3\): it is of run run-a, "
        r"this is run run-b \(--resume, make up RESUME=1, continues it\); starting a new run at "
        rf"version 0; its files moved to {re.escape(str(aside))}",
        line,
    ), line


def test_the_new_runs_pruning_never_reaches_the_files_set_aside(tmp_path):
    _run(tmp_path, "run-a", 2)
    config = parse(["ps", "--checkpoint_dir", str(tmp_path / "ck"), "--run_id", "run-b"], {})
    with MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0) as metrics:
        saver = Checkpointer(_server(), config, IDENTITY, metrics)
        saver.resume()
        for _ in range(checkpoint_files.KEEP + 2):
            push(saver.server, 1, torch.ones(saver.server.state.flat.size), saver.server.version)
            saver.save("test")
    assert len(checkpoint_files.listing(tmp_path / "ck")) == checkpoint_files.KEEP
    assert len(checkpoint_files.listing(tmp_path / "ck" / checkpoint_files.PREVIOUS / "run-a")) == 1
    assert all(checkpoint_files.verify(p)["run_id"] == "run-b" for p in checkpoint_files.listing(tmp_path / "ck"))


def test_resume_continues_another_runs_checkpoint_and_says_which_version(tmp_path, caplog):
    _run(tmp_path, "run-a", 4)
    with caplog.at_level(logging.INFO, logger="app.checkpoint"):
        resumed = _run(tmp_path, "run-b", 0, "--resume", "true")
    assert resumed.server.version == 4 and resumed.saved_version == 4
    assert re.search(
        r"resumed from \S+ckpt-00000004-[0-9a-f]{16}\.pt: version 4 \(run run-a, continued by "
        r"--resume\)",
        caplog.text,
    ), caplog.text
    [record] = [r for r in read(tmp_path / "m" / "ps.jsonl") if r["event"] == "resume"]
    assert record["step"] == 4 and record["run_id"] == "run-a"


def test_a_ps_restarted_within_its_run_resumes_without_resume(tmp_path):
    _run(tmp_path, "run-a", 3)
    assert _run(tmp_path, "run-a", 0).server.version == 3


def test_without_a_run_id_the_newest_unfinished_checkpoint_is_resumed(tmp_path):
    _run(tmp_path, "run-a", 3)
    config = parse(["ps", "--checkpoint_dir", str(tmp_path / "ck")], {})
    with MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0) as metrics:
        saver = Checkpointer(_server(), config, IDENTITY, metrics)
        saver.resume()
    assert saver.server.version == 3


def test_resume_never_continues_a_finished_run_and_keeps_its_final_model(tmp_path):
    _run(tmp_path, "run-a", 3, finish=True)
    final = (tmp_path / "ck" / "final.pt").read_bytes()
    assert _run(tmp_path, "run-b", 0, "--resume", "1").server.version == 0
    aside = tmp_path / "ck" / checkpoint_files.PREVIOUS / "run-a"
    assert (aside / "final.pt").read_bytes() == final and not (tmp_path / "ck" / "final.pt").exists()


def test_set_aside_takes_shard_checkpoints_too_and_never_overwrites(tmp_path):
    for n in (1, 2):
        (tmp_path / "shard1").mkdir(exist_ok=True)
        (tmp_path / "shard1" / f"ckpt-0000000{n}-0123456789abcdef.pt").write_bytes(b"s")
        (tmp_path / f"ckpt-0000000{n}-0123456789abcdef.pt").write_bytes(b"m")
        (tmp_path / "notes.txt").write_text("mine")
        where, count = checkpoint_files.set_aside(tmp_path, "run-a")
        assert where.name == ("run-a" if n == 1 else "run-a-2") and count == 2
        assert (where / "shard1" / f"ckpt-0000000{n}-0123456789abcdef.pt").is_file()
    assert (tmp_path / "notes.txt").read_text() == "mine"  # not a checkpoint: left alone
    assert checkpoint_files.set_aside(tmp_path, "run-b") is None


@pytest.mark.parametrize("value", ["", "run-7", "20261123-180102-ab12cd"])
def test_run_ids_that_name_a_directory_are_accepted(value):
    assert parse(["ps", "--run_id", value], {}).run_id == value


@pytest.mark.parametrize("value", ["../up", "a b", "-x", "x" * 65])
def test_a_run_id_that_cannot_name_a_directory_is_one_line(value):
    with pytest.raises(
        UsageError,
        match=r"^--run_id: .* must be 1 to 64 letters, digits, '\.', '_' or '-', "
        r"starting with a letter or digit$",
    ):
        parse(["ps", f"--run_id={value}"], {})


def test_run_id_and_resume_come_from_the_environment_too():
    config = parse(["ps"], {"PSC_RUN_ID": "r1", "PSC_RESUME": "1"})
    assert config.run_id == "r1" and config.resume is True


# --- real processes: the defect, a fresh start and --resume ----------------

DIGITS = digits(
    lr=0.1,
    seed=1,
    world_size=5,
    eval_every=1000,
    log_every=1,
    rpc_timeout=60,
    join_timeout=180,
    master_addr="127.0.0.1",
)
TIMEOUT = 240


class Job:
    """PS and workers of one run (4 workers) on 127.0.0.1, started one by one."""

    def __init__(self, tmp_path, state, run_id: str, *ps_args: str) -> None:
        self.dir, self.run_id = tmp_path / run_id, run_id
        self.dir.mkdir()
        self.common = [
            *DIGITS,
            "--master_port",
            str(free_port()),
            "--checkpoint_dir",
            str(state),
            "--metrics_dir",
            str(self.dir / "metrics"),
            "--run_id",
            run_id,
        ]
        self.procs = {"ps": start_app(self.dir, "ps", ["ps", *self.common, *ps_args])}

    def worker(self, rank: int, *args: str) -> None:
        name = f"worker{rank}"
        self.procs[name] = start_app(self.dir, name, ["worker", "--rank", str(rank), *self.common, *args])

    def records(self, name: str, event: str) -> list[dict]:
        path = self.dir / "metrics" / f"{name}.jsonl"
        return [r for r in read(path) if r["event"] == event] if path.exists() else []

    def wait_until(self, what: str, check, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0)}
            if dead or time.monotonic() > deadline:
                self.close()
                pytest.fail(
                    f"{what}: not reached ({'exited: ' + str(dead) if dead else 'timeout'})\n"
                    + (self.dir / "ps.err").read_text()
                )
            time.sleep(0.2)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    def ended(self, timeout: float = TIMEOUT) -> dict:
        wait_for(self.procs, timeout, f"run {self.run_id}")
        return {name: finished(self.dir, name, proc) for name, proc in self.procs.items()}


@pytest.fixture(scope="module")
def unfinished_run(tmp_path_factory):
    """The state an interrupted run leaves: ranks 2 and 4 finished (1 epoch), ranks 1 and 3
    never came, the PS stopped (SIGTERM). Its last checkpoint is not final."""
    tmp = tmp_path_factory.mktemp("old")
    state = tmp / "state"
    job = Job(tmp, state, "run-old")
    for rank in (2, 4):
        job.worker(rank, "--num_epochs", "1")
    job.wait_until("ranks 2 and 4 finished", lambda: all(job.procs[f"worker{r}"].poll() == 0 for r in (2, 4)))
    job.procs["ps"].send_signal(signal.SIGTERM)
    job.ended()
    found = checkpoint_files.newest_good(state)
    assert found is not None, (tmp / "run-old" / "ps.err").read_text()
    _, saved = found
    assert saved["run_id"] == "run-old" and not saved["finished"]
    assert {r: p["finished"] for r, p in saved["progress"].items()} == {1: 0, 2: 1, 3: 0, 4: 1}
    return state, saved["version"]


@pytest.mark.slow
def test_resume_keeps_the_ps_up_while_rejoined_finished_ranks_train(unfinished_run, tmp_path):
    """The defect, reproduced: the PS resumes a checkpoint in which ranks 2 and 4 finished; new
    processes of ranks 2 and 4 rejoin and train (more epochs this time), ranks 1 and 3 finish.
    The PS used to count "4 finished of 4" and end, and 2 and 4 failed with PSUnreachable."""
    old, version = unfinished_run
    state = tmp_path / "state"
    shutil.copytree(old, state)
    job = Job(tmp_path, state, "run-new", "--resume", "true")
    try:
        for rank in (2, 4):
            job.worker(rank, "--num_epochs", "6")
        # Each held mid-run as soon as it trains past its resumed epoch, so that it is still
        # training when 1 and 3 finish. Held together, once both had, the faster one could run
        # through its last epochs (a few steps each) while the other caught up, and finish first.
        for rank in (2, 4):
            job.wait_until(
                f"rank {rank} trains again",
                lambda name=f"worker{rank}": any(r["epoch"] >= 2 for r in job.records(name, "train")),
            )
            job.procs[f"worker{rank}"].send_signal(signal.SIGSTOP)
            assert job.procs[f"worker{rank}"].poll() is None, f"worker{rank} ended before it was held"
        for rank in (1, 3):
            job.worker(rank, "--num_epochs", "6", "--max_steps", "3")
        job.wait_until("ranks 1 and 3 finished", lambda: all(job.procs[f"worker{r}"].poll() == 0 for r in (1, 3)))
        assert job.procs["ps"].poll() is None, (job.dir / "ps.err").read_text()
        for rank in (2, 4):
            job.procs[f"worker{rank}"].send_signal(signal.SIGCONT)
        procs = job.ended()
    finally:
        job.close()
    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr}"
    ps_log = procs["ps"].stderr
    assert f": version {version} (run run-old, continued by --resume)" in ps_log, ps_log
    finishes = re.findall(r"(worker\d(?:_r\d)?) finished after \d+ pushes \((.*)\)", ps_log)
    # Ranks 1 and 3 finish first (how many of 2 and 4 have rejoined by then is timing), and
    # every finish counts one more: none of the restored finishes of 2 and 4 is counted.
    assert {name for name, _ in finishes[:2]} == {"worker1", "worker3"}, finishes
    assert [re.search(r"(\d+) finished of 4", f[1]).group(1) for f in finishes] == ["1", "2", "3", "4"], finishes
    assert finishes[-1][1] == "0 live, 4 finished of 4"
    for rank in (2, 4):
        [join] = job.records(f"worker{rank}", "join")
        assert join["epoch"] == 1 and join["batch"] > 0  # resumed where its finished process stopped
        assert max(r["epoch"] for r in job.records(f"worker{rank}", "train")) == 6
        assert "PSUnreachable" not in procs[f"worker{rank}"].stderr


@pytest.mark.slow
def test_a_new_run_after_an_unfinished_one_starts_at_version_0_and_says_so(unfinished_run, tmp_path):
    old, version = unfinished_run
    state = tmp_path / "state"
    shutil.copytree(old, state)
    before = {p.name for p in state.glob("*.pt")}
    job = Job(tmp_path, state, "run-new")
    try:
        job.worker(2, "--num_epochs", "1", "--max_steps", "3")  # rank 2 finished in the old run
        job.wait_until("worker2 ran its 3 steps", lambda: job.procs["worker2"].poll() == 0)
        job.procs["ps"].send_signal(signal.SIGTERM)  # ranks 1, 3, 4 never come: stop here
        procs = job.ended()
    finally:
        job.close()
    assert procs["worker2"].returncode == 0, procs["worker2"].stderr
    aside = state / checkpoint_files.PREVIOUS / "run-old"
    assert re.search(
        rf"not resuming from ckpt-\S+ \(version {version}\): it is of run run-old, this is run "
        rf"run-new .*; starting a new run at version 0; its files moved to {re.escape(str(aside))}$",
        procs["ps"].stderr,
        re.M,
    ), procs["ps"].stderr
    assert {p.name for p in aside.glob("*.pt")} == before  # the old run's files, whole
    [start] = job.records("ps", "start")
    assert start["step"] == 0 and not job.records("ps", "resume")
    [join] = job.records("worker2", "join")
    assert (join["epoch"], join["batch"], join["step"]) == (1, 0, 0)  # not the old run's progress
    saved = [checkpoint_files.verify(p) for p in checkpoint_files.listing(state)]
    assert saved and {s["run_id"] for s in saved} == {"run-new"} and max(s["version"] for s in saved) == 3


def test_resume_of_a_run_id_continues_that_run_not_the_newest(tmp_path, caplog):
    """`up --resume RUN_ID`: run-a was set aside by run-b, which is newer and further on; a PS
    of run-a with --resume continues run-a's version 3 (run-b's files set aside in turn)."""
    _run(tmp_path, "run-a", 3)
    _run(tmp_path, "run-b", 5)  # sets run-a aside, then gets to version 5
    with caplog.at_level(logging.INFO, logger="app.checkpoint"):
        resumed = _run(tmp_path, "run-a", 0, "--resume", "true")
    assert resumed.server.version == 3
    assert all(checkpoint_files.verify(p)["run_id"] == "run-a" for p in checkpoint_files.listing(tmp_path / "ck"))
    aside = tmp_path / "ck" / checkpoint_files.PREVIOUS / "run-b"
    assert [checkpoint_files.verify(p)["version"] for p in checkpoint_files.listing(aside)] == [5]
    assert "--resume of run run-a: the files of run run-b here" in caplog.text, caplog.text
    # and with run-b's files already set aside, the same: run-a, not the newest
    assert _run(tmp_path, "run-c", 0).server.version == 0  # sets run-a (now at 3) aside
    assert _run(tmp_path, "run-b", 0, "--resume", "true").server.version == 5
