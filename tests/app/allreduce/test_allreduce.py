"""Strategy allreduce (app/allreduce/): DDP workers, no PS. Units without processes,
then 2 real processes on 127.0.0.1 (CPU, Gloo, the built-in CNN on digits)."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from app.allreduce import hooks, world
from app.allreduce import trainer as ddp
from app.checkpoint import files as checkpoint_files
from app.config import UsageError, parse
from app.contract import UNNAMED_RUN, event_dir
from app.data import datasets
from app.training import models
from app.training.evaluate import evaluate
from app.training.metrics import read

from app_testkit import (
    REPO,
    Process,
    app_env,
    assert_same_curves,
    curves,
    digits,
    expected_curves,
    finished,
    free_port,
    job_args,
    start_app,
    wait_for,
)
from needs import unavailable

# As configs/cpu-smoke.yaml: 10 epochs, each of 2 ranks takes 22 steps an epoch.
EPOCHS, STEPS_PER_EPOCH = 10, 22
STEPS = EPOCHS * STEPS_PER_EPOCH
DIGITS = digits(
    strategy="allreduce", lr=0.1, num_epochs=EPOCHS, eval_every=100, checkpoint_every=100, rpc_timeout=30, seed=1
)
CAP_SECONDS = 90


def config(*args: str, env: dict[str, str] | None = None):
    return parse(["worker", "--strategy", "allreduce", *args], env or {})


# --- units ------------------------------------------------------------------


def test_world_is_the_workers_or_torchrun():
    w = world.world_of(config("--rank", "3", "--world_size", "4", "--master_addr", "w1", "--master_port", "7"), {})
    assert (w.rank, w.size, w.addr, w.port, w.torchrun) == (2, 3, "w1", 7, False)
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "LOCAL_RANK": "1"}
    w = world.world_of(config(), env)
    assert (w.rank, w.size, w.addr, w.port, w.local_rank, w.torchrun) == (1, 2, "10.0.0.1", 29400, 1, True)
    assert world.world_of(config(), {"RANK": "1"}).torchrun is False  # only all four together
    with pytest.raises(UsageError, match="RANK 2 must be in 0..1"):
        world.world_of(config(), {**env, "RANK": "2"})


def test_every_rank_takes_as_many_steps_and_a_resumed_epoch_skips_what_it_trained():
    train = datasets.load("digits", "", "train", 0).data  # 1438 samples: not divisible by 3
    worlds = [world.World(r, 3, "x", 1, 0, False) for r in range(3)]
    samplers = [ddp.EpochSampler(train, w, seed=5) for w in worlds]
    for s in samplers:
        s.set_epoch(2)
    orders = [list(s) for s in samplers]
    assert len({len(o) for o in orders}) == 1 == len({len(s) for s in samplers})
    assert set().union(*orders) == set(range(len(train)))  # together: the whole epoch
    samplers[0].set_epoch(2, skip=64)
    assert list(samplers[0]) == orders[0][64:]
    samplers[0].set_epoch(3)
    assert list(samplers[0]) != orders[0]  # set_epoch reshuffles


def test_job_state_round_trips_through_a_verified_checkpoint(tmp_path):
    model = models.build("cnn", 1, 10, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    opt.step()
    state = ddp.JobState(model, opt)
    state.progress = ddp.Progress(step=7, epoch=2, batch=3, samples=448)
    path = checkpoint_files.save({**state.checkpoint(), "strategy": "allreduce"}, tmp_path)
    loaded = checkpoint_files.verify(path)  # weights_only load: plain tensors and numbers
    other = models.build("cnn", 1, 10, seed=1)
    other_state = ddp.JobState(other, torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9))
    other_state.restore(loaded)
    assert other_state.progress == state.progress and loaded["finished"] is False
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(
        other_state.optimizer.state_dict()["state"][0]["momentum_buffer"],
        opt.state_dict()["state"][0]["momentum_buffer"],
    )


def test_compression_hooks():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    assert hooks.compress_hook("fp16", "gloo") is default_hooks.fp16_compress_hook
    assert hooks.compress_hook("bf16", "nccl") is default_hooks.bf16_compress_hook
    assert hooks.compress_hook("bf16", "gloo") is hooks.bf16_gloo_hook  # torch's refuses Gloo


def test_evaluate_leaves_the_model_training():
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10), nn.BatchNorm1d(10))
    held_out = datasets.load("digits", "", "test", 0)
    scores = evaluate(
        model, datasets.eval_loader(held_out.data, 64, 0), torch.device("cpu"), "accuracy", nn.CrossEntropyLoss()
    )
    assert list(scores) == ["accuracy", "loss"] and 0 <= scores["accuracy"] <= 1 and scores["loss"] > 0
    assert model.training


# --- processes ----------------------------------------------------------------


def start(tmp_path: Path, workers: int, args: list[str], tag: str = "") -> dict[str, subprocess.Popen]:
    common = [*job_args(tmp_path, workers + 1), *args]
    return {
        f"worker{rank}": start_app(tmp_path, f"worker{rank}{tag}", ["worker", "--rank", str(rank), *common])
        for rank in range(1, workers + 1)
    }


def finish(tmp_path: Path, procs: dict[str, subprocess.Popen], timeout: float, tag: str = "") -> dict[str, Process]:
    wait_for(procs, timeout, "the DDP job")
    return {n: finished(tmp_path, n, p, f"{n}{tag}") for n, p in procs.items()}


def final_accuracy(stdout: str) -> float:
    lines = [line for line in stdout.splitlines() if line.startswith("Accuracy: ")]
    assert len(lines) == 1, stdout
    return float(lines[0].split()[1])


@pytest.mark.slow
def test_two_workers_learn_digits_checkpoint_and_write_metrics(tmp_path):
    procs = finish(tmp_path, start(tmp_path, 2, DIGITS), CAP_SECONDS)

    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr}"
    out = procs["worker1"].stdout
    accuracy = final_accuracy(out)
    assert accuracy >= 0.90
    assert re.search(r"^Time: \d+\.\d\d seconds$", out, re.M), out
    assert "Accuracy" not in procs["worker2"].stdout  # rank 0 evaluates
    for name in ("worker1", "worker2"):
        assert re.search(
            rf"^{name} \| Epoch: {EPOCHS} \| Batch: 22 \| Loss: \d+\.\d\d \| \d+ samples/s$", procs[name].stdout, re.M
        )

    metrics = tmp_path / "metrics"
    w1, w2 = read(metrics / "worker1.jsonl"), read(metrics / "worker2.jsonl")
    steps = STEPS
    assert [r["event"] for r in w1 if r["event"] in ("start", "join", "end")] == ["start", "join", "end"]
    assert [(r["strategy"], r["world_size"], r["workers"]) for r in w2 if r["event"] == "start"] == [
        ("allreduce", 3, 2)
    ]
    assert w1[0]["step"] == 0 and w1[-1]["step"] == w2[-1]["step"] == steps
    assert w1[-1]["accuracy"] == accuracy and w1[-1]["seconds"] > 0
    train = [r for r in w1 + w2 if r["event"] == "train"]
    assert train and all(r["samples_per_s"] > 0 and r["loss"] >= 0 for r in train)
    evals = [r for r in w1 if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [100, 200, steps]
    assert [r["samples"] for r in evals] == [100 * 64, 200 * 64, steps * 64]  # both ranks' samples
    assert [r for r in w2 if r["event"] == "eval"] == []
    for name, records in (("worker1", w1), ("worker2", w2)):  # TensorBoard: the same numbers
        assert_same_curves(curves(event_dir(str(metrics), "", name)), expected_curves(records), name)
    assert {"eval/accuracy", "eval/updates_per_s", "train/step_seconds"} <= set(
        curves(metrics / "tensorboard" / UNNAMED_RUN / "worker1")
    )

    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name.split("-")[1] for p in checkpoint_files.listing(ckpts)) == [
        "00000100",
        "00000200",
        f"{steps:08d}",
    ]
    final = torch.load(ckpts / "final.pt", weights_only=True)
    assert final["finished"] is True and final["version"] == steps and final["strategy"] == "allreduce"
    assert final["progress"] == {"step": steps, "epoch": EPOCHS, "batch": 22, "samples": steps * 64}


def _wait_for_checkpoint(tmp_path: Path, procs: dict[str, subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not checkpoint_files.listing(tmp_path / "checkpoints"):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
            errors = {n: (tmp_path / f"{n}.err").read_text()[-2000:] for n in procs}
            pytest.fail(f"no checkpoint while the job ran: {errors}")
        time.sleep(0.1)


def tcp_listeners(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket process `pid` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed as we looked
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, this process's
                address, port = fields[1].rsplit(":", 1)
                raw = bytes.fromhex(address)
                words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]  # each 32-bit word little-endian
                found.add((str(ipaddress.ip_address(b"".join(words))), int(port, 16)))
    return found


@pytest.mark.slow
def test_a_lost_peer_stops_the_job_and_a_restart_resumes_from_the_checkpoint(tmp_path):
    """Over the FileStore rendezvous in a private directory (--socket_dir): the killed attempt
    leaves its store behind, the restarted job makes and finds a fresh one, and no rank listens
    on TCP but on the loopback (Gloo), the TCPStore's port never."""
    args = [a if a != "100" else "20" for a in DIGITS]  # checkpoint (and evaluate) every 20 steps
    args += ["--socket_dir", str(tmp_path / "private")]
    procs = start(tmp_path, 2, args)
    _wait_for_checkpoint(tmp_path, procs, CAP_SECONDS)
    listening = {name: tcp_listeners(p.pid) for name, p in procs.items()}
    assert listening["worker1"], listening  # Gloo's
    assert {a for found in listening.values() for a, _ in found} == {"127.0.0.1"}, listening
    master_ports = {int(p.args[p.args.index("--master_port") + 1]) for p in procs.values()}
    assert not master_ports & {port for found in listening.values() for _, port in found}, listening
    assert oct((tmp_path / "private").stat().st_mode & 0o777) == "0o700"
    procs["worker2"].kill()
    first = finish(tmp_path, procs, 30)
    assert first["worker1"].returncode == 1, first["worker1"].stderr
    errors = [line for line in first["worker1"].stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "worker1 failed: PeerLost: lost a peer of the allreduce job" in errors[0], errors
    # On the way out worker1 saves its last whole step (unless its periodic checkpoint has it).
    saved = [r for r in read(tmp_path / "metrics" / "worker1.jsonl") if r["event"] == "checkpoint"]
    last_train = [r for r in read(tmp_path / "metrics" / "worker1.jsonl") if r["event"] == "train"][-1]
    stopped_at = saved[-1]["step"]
    assert stopped_at >= last_train["step"] and (saved[-1]["why"] == "on exit" or stopped_at % 20 == 0), saved

    second = finish(tmp_path, start(tmp_path, 2, args, tag="-2"), CAP_SECONDS, tag="-2")
    assert {p.name: p.returncode for p in second.values()} == {"worker1": 0, "worker2": 0}, second["worker1"].stderr
    assert final_accuracy(second["worker1"].stdout) >= 0.90
    for name in ("worker1", "worker2"):
        records = read(tmp_path / "metrics" / f"{name}.jsonl")
        join = [r for r in records if r["event"] == "join"][-1]
        assert join["step"] == stopped_at > 0, (name, join)
        after = [r["step"] for r in records if r["event"] == "train" and r["time"] > join["time"]]
        assert after and min(after) > stopped_at and records[-1]["step"] == STEPS
    assert "resumed from" in second["worker1"].stderr
    assert "joined the allreduce job at files in" in second["worker2"].stderr
    assert len(list((tmp_path / "private").glob("rendezvous-*"))) == 1  # the first attempt's store is gone


@pytest.mark.slow
def test_torchrun_launches_the_same_job(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        unavailable("no torchrun next to this python (torch installs it)")
    args = [a if a != str(EPOCHS) else "2" for a in DIGITS]
    p = subprocess.run(
        [
            torchrun,
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "-m",
            "app",
            "worker",
            "--metrics_dir",
            str(tmp_path / "metrics"),
            "--checkpoint_dir",
            str(tmp_path / "checkpoints"),
            *args,
        ],
        env=app_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CAP_SECONDS,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"^Accuracy: 0\.\d{4}$", p.stdout, re.M), p.stdout
    assert read(tmp_path / "metrics" / "worker2.jsonl")[-1]["step"] == 2 * 22
    assert (tmp_path / "checkpoints" / "final.pt").is_file()


@pytest.mark.slow
def test_with_the_file_cache_each_rank_holds_an_equal_padded_shard_and_takes_as_many_steps(tmp_path):
    """47 training images: unpadded shards of 24 and 23 would take 6 and 5 steps of 4 (a hang)."""
    from PIL import Image

    root = tmp_path / "data"
    for c, colour in enumerate(((250, 0, 0), (0, 0, 250))):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(26):
            Image.new("RGB", (20, 18), tuple(max(0, v - i) for v in colour)).save(root / f"c{c}" / f"{i:02d}.png")
    args = [
        "--strategy",
        "allreduce",
        "--model",
        "cnn",
        "--dataset",
        "imagefolder",
        "--data_dir",
        str(root),
        "--image_size",
        "16",
        "--image_cache",
        "file",
        "--cache_dir",
        str(tmp_path / "cache"),
        "--batch_size",
        "4",
        "--lr",
        "0.05",
        "--num_epochs",
        "2",
        "--loader_workers",
        "0",
        "--rpc_timeout",
        "30",
    ]
    procs = finish(tmp_path, start(tmp_path, 2, args), CAP_SECONDS)
    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr[-3000:]}"
    ends = [read(tmp_path / "metrics" / f"worker{r}.jsonl")[-1] for r in (1, 2)]
    assert ends[0]["step"] == ends[1]["step"] == 12
    sizes = sorted(f.name.split("-")[2] for f in (tmp_path / "cache").glob("*.u8"))
    assert sizes == ["24", "24", "5"]  # two padded shards and rank 0's held-out set


def _ddp_trainer(optimizer_step=None, rank0=None):
    config = parse(["worker", "--strategy", "allreduce", "--eval_every", "1"], {})
    model = _linear(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    if optimizer_step is not None:
        optimizer.step = optimizer_step(optimizer.step)
    state = ddp.JobState(model, optimizer)
    at = world.World(0, 1, "127.0.0.1", 1, 0, False)
    metrics = SimpleNamespace(write=lambda *a, **f: None)
    trainer = ddp.AllreduceTrainer(
        config,
        at,
        _Wrapped(model),
        optimizer,
        state,  # type: ignore[arg-type]
        None,
        None,
        torch.device("cpu"),
        metrics,
        rank0,
    )
    return trainer, state


def _linear(size: int, value: float = 0.0) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.constant_(model.weight, value)
    return model


class _Wrapped(nn.Module):
    """What DDP looks like to the Trainer: the model as `.module`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_sigterm_during_a_ddp_step_lands_after_the_step_and_its_label():
    import os
    import signal

    from app.runtime import lifecycle

    def sigterm_inside(step):
        def wrapped(*a, **k):
            result = step(*a, **k)
            os.kill(os.getpid(), signal.SIGTERM)  # after the weights moved, before the count
            return result

        return wrapped

    trainer, state = _ddp_trainer(sigterm_inside)
    previous = signal.signal(signal.SIGTERM, lifecycle._raise_exit)
    try:
        with pytest.raises(SystemExit):
            trainer.step(torch.ones(2, 4), torch.zeros(2, dtype=torch.long), epoch=1, batch=1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert state.progress.step == 1 and state.progress.batch == 1  # the checkpoint's label matches


def test_rank0_evaluates_in_the_background_so_the_next_step_does_not_wait_for_it(monkeypatch):
    import threading

    release, evaluated = threading.Event(), []

    def slow_accuracy(model, loader, device, metrics, loss):
        release.wait(60)
        evaluated.append(model)
        return {"accuracy": 0.5, "loss": 1.0}

    monkeypatch.setattr(ddp, "evaluate", slow_accuracy)
    checkpoints = SimpleNamespace(due=lambda: False)
    trainer, state = _ddp_trainer(rank0=(checkpoints, None))
    state.progress = ddp.Progress(step=1)
    trainer.rank0_duties()  # returns while the evaluation is still blocked
    assert trainer.evaluating() and not evaluated
    release.set()
    trainer.wait_for_evaluation()
    assert len(evaluated) == 1 and evaluated[0] is not trainer.model.module  # a copy of the weights
