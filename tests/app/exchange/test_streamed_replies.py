"""A streamed reply: the PS answers a plain async push once the first partition of the new state
is written (app.ps.state's `step_streamed`, app.ps.server's `submit`), raising each reply region's
word as it writes the others (app.exchange.progress), and a CPU worker's forward waits for each
partition before it reads it (app.exchange.streamed_pull): between real processes, with a real
segment in /dev/shm."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from app.exchange import progress
from app.exchange.layout import cut
from app.exchange.ps_end import SharedExchange
from app.exchange.route import PSUnreachable
from app.exchange.segment import Segment
from app.exchange.streamed_pull import StreamedPull
from app.exchange.wire import Push, Reply
from app.ps.server import ParameterServer, ServerConfig

from app_testkit import DIGITS, REPO, final_accuracy, run_cluster

pytestmark = pytest.mark.skipif(not progress.available(), reason="replies are streamed on x86-64 Linux only")


@pytest.fixture
def shm_dir(tmp_path):
    """A directory of its own in /dev/shm, removed afterwards (not psc-*: other tests' PS sweep those)."""
    path = Path("/dev/shm") / f"test-psc-{os.getpid()}-{tmp_path.name}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def reply_word(shm_dir):
    """A segment with one reply region: the address of its word."""
    segment = Segment.create(str(shm_dir), 8, ["reply1.0"])
    try:
        address = segment.word_address("reply1.0")
        assert address is not None
        yield address
    finally:
        segment.close()


# --- the word ------------------------------------------------------------------------------

WAITER = """
import sys, time
from app.exchange import progress
from app.exchange.segment import Offer, Segment
segment = Segment.attach(Offer(sys.argv[1], sys.argv[2], 4, ("reply1.0",)))
address = segment.word_address("reply1.0")
print("waiting", flush=True)
started = time.monotonic()
print(progress.wait_until(address, int(sys.argv[3]), 3, 30.0), round(time.monotonic() - started, 3), flush=True)
"""


def test_a_waiter_in_another_process_sleeps_until_the_word_has_counted_its_partitions(shm_dir):
    segment = Segment.create(str(shm_dir), 4, ["reply1.0"])
    try:
        address = segment.word_address("reply1.0")
        assert address is not None
        word = progress.Progress(address)
        base = word.count
        env = dict(os.environ, PYTHONPATH=str(REPO))
        waiter = subprocess.Popen(
            [sys.executable, "-c", WAITER, segment.path, segment.nonce, str(base)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert waiter.stdout is not None and waiter.stdout.readline().strip() == "waiting"
        for _ in range(3):
            time.sleep(0.2)
            word.publish()
        out, _ = waiter.communicate(timeout=60)
        woke, seconds = out.split()
        assert woke == "True" and 0.3 < float(seconds) < 20  # it slept through the first two
    finally:
        segment.close()


def test_a_wait_gives_up_after_its_timeout_and_the_count_wraps_around(shm_dir):
    segment = Segment.create(str(shm_dir), 4, ["reply1.0"])
    try:
        address = segment.word_address("reply1.0")
        assert address is not None
        started = time.monotonic()
        assert not progress.wait_until(address, 0, 1, 0.2)
        assert time.monotonic() - started >= 0.2
        assert progress.passed(2, 0xFFFFFFFE, 4) and not progress.passed(2, 0xFFFFFFFE, 5)
        assert not progress.passed(0xFFFFFFFE, 2, 1)  # a word behind its base has counted nothing
    finally:
        segment.close()


# --- the PS's side ---------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.BatchNorm1d(30), nn.Linear(30, 20), nn.Linear(20, 10))


def _server(shm_dir: Path, strategy: str = "async", **state: object) -> ParameterServer:
    """A PS over _model() with its segment, cut in partitions of 500 values for the test."""
    model = _model()
    config = ServerConfig.from_config(_config(strategy, **state))
    shared = SharedExchange.open(str(shm_dir), _size(model), 1, overlap=False, sync=strategy == "sync")
    server = ParameterServer(model, config, shared=shared)
    server.state.parts = cut([p.numel() for p in model.parameters()], server.state.size, 500)
    server.join(1, "worker1")
    return server


def _config(strategy: str, **state: object):
    from app.config import parse

    argv = ["ps", "--world_size", "2", "--lr", "0.1", "--strategy", strategy]
    for key, value in state.items():
        argv += [f"--{key}", str(value)]
    return parse(argv, {})


def test_a_streamed_step_is_torch_optim_sgds_value_for_value(shm_dir):
    """Partition by partition, momentum (its first step too), weight decay and a staleness
    scale give what torch.optim.SGD gives on the whole vector."""
    server = _server(shm_dir, momentum=0.9, weight_decay=0.01, staleness_lr="true")
    try:
        params = [p for p in _model().parameters()]
        reference = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
        sgd = torch.optim.SGD([reference], lr=0.1, momentum=0.9, weight_decay=0.01)
        n = reference.numel()
        torch.manual_seed(1)
        for step in range(3):
            message = torch.randn(server.state.size)
            pulled = max(0, server.version - step % 2)  # a stale push is scaled down
            answer = server.submit(Push(1, "worker1", pulled, streamed=True), message, server.shared.progress)
            assert answer.wait().streamed >= 0
            staleness = server.version - 1 - pulled
            reference.grad = message[:n] * (1.0 / max(1, staleness))
            sgd.step()
            assert torch.equal(server.state.vector[:n], reference.detach()), step
            assert torch.equal(server.state.vector[n:], message[n:])  # the buffers are the pushed ones
    finally:
        server.shared.close()


def test_a_streamed_answer_goes_with_its_first_partition_and_the_rest_is_written_before_the_lock_is_let_go(shm_dir):
    server = _server(shm_dir)
    try:
        parts = server.state.parts
        assert len(parts) >= 3
        old = server.state.vector.clone()
        word = server.shared.progress(server.replies.take(1))  # the rank's one reply buffer
        server.replies.take(1)  # put back in turn
        assert word is not None
        base = word.count
        rests: list = []
        message = torch.ones(server.state.size)
        answer = server.submit(Push(1, "worker1", 0, streamed=True), message, server.shared.progress, rests.append)
        assert answer.done()  # answered before the rest is written
        reply = answer.value()
        assert isinstance(reply, Reply) and reply.streamed == base and reply.version == 1
        assert word.count == base + 1
        n = server.state.num_params
        first = parts[0][1]
        assert torch.equal(reply.vector[:first], old[:first] - 0.1)  # the first partition is the new state
        assert torch.equal(reply.vector[n:], message[n:])  # and the buffers
        pulled: list[torch.Tensor] = []
        puller = threading.Thread(target=lambda: pulled.append(server.pull(1)[0]))
        puller.start()
        puller.join(timeout=0.5)
        assert puller.is_alive()  # the lock is held until the rest is written
        rests[0]()
        puller.join(timeout=30)
        assert word.count == base + len(parts)
        assert torch.equal(pulled[0][:n], old[:n] - 0.1)
    finally:
        server.shared.close()


@pytest.mark.parametrize("strategy", ["ssp", "sync"])
def test_a_strategy_that_may_hold_an_answer_never_streams_it(shm_dir, strategy):
    server = _server(shm_dir, strategy)
    try:
        message = torch.ones(server.state.size)
        answer = server.submit(Push(1, "worker1", 0, streamed=True), message, server.shared.progress, lambda rest: None)
        assert answer.wait().streamed == -1 and not server.state.unfinished
        assert server.stats()["streamed"] == 0
    finally:
        server.shared.close()


def test_a_push_that_does_not_ask_is_answered_whole(shm_dir):
    server = _server(shm_dir)
    try:
        answer = server.submit(Push(1, "worker1", 0), torch.ones(server.state.size), server.shared.progress)
        assert answer.wait().streamed == -1 and server.stats()["streamed"] == 0
    finally:
        server.shared.close()


# --- the worker's side ----------------------------------------------------------------------


class Seen(nn.Module):
    """Records the word's count as the forward reaches each layer (after the waits hooked before)."""

    def __init__(self, model: nn.Module, word: progress.Progress) -> None:
        super().__init__()
        self.counts: list[int] = []
        for layer in model:
            layer.register_forward_pre_hook(lambda _m, _i: self.counts.append(word._word.value))


def test_a_workers_forward_reads_each_partition_once_written_and_starts_before_the_last(reply_word):
    model = _model().eval()
    address = reply_word
    word = progress.Progress(address)
    parts = cut([p.numel() for p in model.parameters()], _size(model), 500)
    needs = _needs(model, parts)
    streamed = StreamedPull(model, parts, timeout=30.0, peer="ps")
    model(torch.zeros(2, 40))  # the first forward records the order (nothing streamed yet)
    base = word.count
    streamed.expect(address, base)
    seen = Seen(model, word)  # its hooks run after the waits

    def write() -> None:
        for _ in parts:
            time.sleep(0.05)
            word.publish()

    writer = threading.Thread(target=write)
    writer.start()
    model(torch.zeros(2, 40))
    streamed.settle()
    writer.join()
    reached = [count - base for count in seen.counts]
    assert all(got >= needs[i] + 1 for i, got in enumerate(reached)), (reached, needs)
    assert reached[0] < len(parts)  # the first layer computed while the last partition was not written
    assert word.count - base == len(parts)


def test_a_partition_never_written_is_the_ps_lost_after_the_timeout(reply_word):
    model = _model().eval()
    parts = cut([p.numel() for p in model.parameters()], _size(model), 500)
    streamed = StreamedPull(model, parts, timeout=0.3, peer="ps")
    model(torch.zeros(2, 40))
    streamed.expect(reply_word, progress.Progress(reply_word).count)
    with pytest.raises(PSUnreachable, match="ps wrote 0 of the"):
        model(torch.zeros(2, 40))
    streamed.whole()  # a reply that came whole: no wait, no hook
    model(torch.zeros(2, 40))
    assert streamed.handles == []


def test_a_reply_whole_before_the_first_forward_leaves_that_forward_to_record_the_order(reply_word):
    """The hooks that record the forward's order stay through a whole reply that comes before
    any forward: the streamed reply after it is still waited for, partition by partition."""
    model = _model().eval()
    parts = cut([p.numel() for p in model.parameters()], _size(model), 500)
    streamed = StreamedPull(model, parts, timeout=0.3, peer="ps")
    streamed.whole()
    model(torch.zeros(2, 40))
    streamed.expect(reply_word, progress.Progress(reply_word).count)
    with pytest.raises(PSUnreachable, match="ps wrote 0 of the"):
        model(torch.zeros(2, 40))


OWNER = """
import sys, time
from app.exchange.segment import Segment
segment = Segment.create(sys.argv[1], 8, ["reply1.0"])
print(segment.path, segment.nonce, flush=True)
time.sleep(600)
"""


def test_a_ps_killed_before_it_wrote_a_partition_is_found_out_in_a_second_not_at_the_timeout(shm_dir):
    """The segment's owner, a real process, killed -9 while the forward waits for a partition."""
    from app.exchange.segment import Offer

    env = dict(os.environ, PYTHONPATH=str(REPO))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(shm_dir)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert owner.stdout is not None
        path, nonce = owner.stdout.readline().split()
        segment = Segment.attach(Offer(path, nonce, 8, ("reply1.0",)))
        assert segment.owned()
        address = segment.word_address("reply1.0")
        assert address is not None
        model = _model().eval()
        parts = cut([p.numel() for p in model.parameters()], _size(model), 500)
        streamed = StreamedPull(model, parts, timeout=120.0, peer="ps", alive=segment.owned)
        model(torch.zeros(2, 40))
        streamed.expect(address, progress.Progress(address).count)
        threading.Timer(0.5, owner.kill).start()
        started = time.monotonic()
        with pytest.raises(PSUnreachable, match="ps ended while it wrote its answer"):
            model(torch.zeros(2, 40))
        assert time.monotonic() - started < 30
        assert not segment.owned()
    finally:
        owner.kill()
        owner.wait()


def _size(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers() if b.is_floating_point())


def _needs(model: nn.Module, parts: list[tuple[int, int]]) -> list[int]:
    """The last partition each layer's parameters are in (the float buffers are written with the first)."""
    needs, at = [], 0
    for layer in model:
        last = 0
        for p in layer.parameters():
            last = max(j for j, (start, _) in enumerate(parts) if start < at + p.numel())
            at += p.numel()
        needs.append(last)
    return needs


def test_a_job_of_processes_streams_its_async_replies_and_learns(tmp_path):
    """A real PS process and worker through shared memory: every async push is streamed (the end
    record's `streamed`), and the model learns."""
    done = run_cluster(tmp_path, 1, [*DIGITS, "--num_epochs", "4"], timeout=150)
    assert all(p.returncode == 0 for p in done.values()), {n: p.stderr[-2000:] for n, p in done.items()}
    records = [json.loads(line) for line in next(tmp_path.glob("metrics/**/ps.jsonl")).read_text().splitlines()]
    end = next(r for r in records if r["event"] == "end")
    assert end["streamed"] == sum(end["pushes"].values()) > 0
    assert final_accuracy(done["ps"].stdout) >= 0.85
