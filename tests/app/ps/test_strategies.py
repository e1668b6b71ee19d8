"""The PS strategies (sync, ssp, staleness-aware lr), overlap and gradient compression.

Unit tests drive `ParameterServer.submit` directly (its futures show who waits);
the slow ones run real PS + worker processes over RPC on digits.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from app.config import parse
from app.data import datasets
from app.exchange.wire import Refusal
from app.ps.server import ParameterServer
from app.training import models
from app.training.flat import FlatModel
from app.training.metrics import read
from app.worker.compress import Compressor
from app.worker.trainer import Trainer

from app_testkit import (
    digits,
    finished,
    job_args,
    ps_server,
    push,
    recording_channel,
    run_cluster,
    start_app,
    started,
    submit,
    wait_for,
)


def _linear(size: int, value: float = 0.0) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.constant_(model.weight, value)
    return model


def _server(strategy: str, workers: int = 2, size: int = 4, **kw) -> ParameterServer:
    server = ps_server(_linear(size), lr=1.0, momentum=0.0, num_trainers=workers, strategy=strategy, **kw)
    for rank in range(1, workers + 1):
        server.join(rank, f"worker{rank}")
    return server


# --- sync -------------------------------------------------------------------------


def test_sync_holds_each_push_until_every_worker_pushed_then_applies_the_average():
    server = _server("sync", workers=3)
    first = submit(server, 1, torch.full((4,), 1.0), 0)
    second = submit(server, 2, torch.full((4,), 2.0), 0)
    assert not first.done() and not second.done() and server.version == 0
    third = submit(server, 3, torch.full((4,), 6.0), 0)
    replies = [f.wait() for f in (first, second, third)]
    assert [r.version for r in replies] == [1, 1, 1]
    assert all(torch.equal(r.vector, torch.full((4,), -3.0)) for r in replies)  # 0 - 1.0 * mean(1, 2, 6)
    assert server.members.pushes == {1: 1, 2: 1, 3: 1} and server.stats()["staleness_max"] == 0


def test_a_sync_round_folded_as_it_landed_is_averaged_again_when_a_pusher_is_dropped():
    """Each push is folded into the round as it lands; a rank dropped after its push was
    folded leaves the round, and the round's mean is the remaining pushes' alone."""
    server = _server("sync", workers=3)
    first = submit(server, 1, torch.full((4,), 2.0), 0)
    dropped = submit(server, 2, torch.full((4,), 100.0), 0)
    server.drop(2, "worker2")  # answered with the current state; its push is not applied
    assert dropped.wait().version == 0 and not first.done()
    last = submit(server, 3, torch.full((4,), 4.0), 0)
    assert [f.wait().version for f in (first, last)] == [1, 1]
    assert torch.equal(last.wait().vector, torch.full((4,), -3.0))  # 0 - 1.0 * mean(2, 4)


def test_a_rank_that_pushes_again_from_a_new_process_counts_once_in_the_round():
    server = _server("sync", workers=2)
    old = submit(server, 1, torch.full((4,), 50.0), 0)
    server.join(1, "worker1-b")  # its new process
    new = submit(server, 1, torch.full((4,), 2.0), 0, name="worker1-b")
    assert old.wait().kind == "stale" and not new.done()
    other = submit(server, 2, torch.full((4,), 4.0), 0)
    assert torch.equal(other.wait().vector, torch.full((4,), -3.0)) and new.wait().version == 1


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_sharded_sync_round_is_the_whole_vectors_round_on_its_slice(momentum):
    """A PS shard folds its slice of each push as the whole PS does."""
    whole = ps_server(_linear(6), lr=0.5, momentum=momentum, num_trainers=2, strategy="sync")
    part = ps_server(_linear(6), lr=0.5, momentum=momentum, num_trainers=2, strategy="sync", part=(2, 5))
    for server in (whole, part):
        for rank in (1, 2):
            server.join(rank, f"worker{rank}")
    torch.manual_seed(4)
    for round_ in range(3):
        pushes = [torch.randn(whole.state.size) for _ in (1, 2)]
        a = [submit(whole, r, p, round_) for r, p in zip((1, 2), pushes)]
        b = [submit(part, r, p[2:5].clone(), round_) for r, p in zip((1, 2), pushes)]
        assert torch.allclose(b[0].wait().vector, a[0].wait().vector[2:5], rtol=1e-6, atol=1e-7)


def test_sync_round_closes_without_a_rank_that_finished_or_was_dropped():
    server = _server("sync", workers=3)
    server.finish(3, pushes=0)
    first = submit(server, 1, torch.full((4,), 2.0), 0)
    assert not first.done()
    second = submit(server, 2, torch.full((4,), 4.0), 0)
    assert second.wait().version == 1 and first.done()
    # worker2 dies before its next push: dropping it answers worker1 alone
    alone = submit(server, 1, torch.full((4,), 1.0), 1)
    assert not alone.done()
    server.drop(2, "worker2")
    reply = alone.wait()
    assert reply.version == 2 and torch.equal(reply.vector, torch.full((4,), -4.0))


def test_a_first_rank_joining_while_a_round_is_open_is_counted_in_that_round():
    """A rank of the job's start that joins after another pushed is waited for in that round
    (the open round already counted it): one update for the two pushes, not two."""
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, strategy="sync")
    server.join(1, "worker1")
    early = submit(server, 1, torch.full((4,), 2.0), 0)
    server.join(2, "worker2")  # the round is open: worker1's push is held
    server.unblock()  # the PS process's tick
    assert not early.done()
    late = submit(server, 2, torch.full((4,), 4.0), 0)
    assert [f.wait().version for f in (early, late)] == [1, 1] and server.version == 1
    assert torch.equal(late.wait().vector, torch.full((4,), -3.0))


def test_sync_waits_for_a_rank_that_has_not_joined_yet():
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, strategy="sync")
    server.join(1, "worker1")
    early = submit(server, 1, torch.ones(4), 0)
    assert not early.done()
    server.join(2, "worker2")
    submit(server, 2, torch.ones(4), 0)
    assert early.wait().version == 1


# --- ssp --------------------------------------------------------------------------


def test_ssp_answers_a_worker_only_within_the_staleness_bound_of_the_slowest():
    server = _server("ssp", workers=2, staleness=1)
    assert submit(server, 1, torch.ones(4), 0).wait().lead == 1  # 1 ahead of worker2: allowed
    held = submit(server, 1, torch.ones(4), 1)  # 2 ahead: waits
    assert not held.done() and server.version == 2  # applied at once all the same
    reply = submit(server, 2, torch.ones(4), 0).wait()
    assert reply.staleness == 2 and reply.lead == 0
    released = held.wait()
    assert released.lead == 1 and released.version == 3  # the state when it was let go


def test_async_never_holds_a_reply():
    server = _server("async", workers=2)
    for step in range(5):
        assert submit(server, 1, torch.ones(4), step).done()
    assert server.members.lead(1, server.version) == 5


def test_staleness_aware_lr_divides_the_step_by_the_staleness():
    server = _server("ssp", workers=2, staleness=10, staleness_lr=True)
    push(server, 1, torch.ones(4), 0)  # staleness 0: full lr, w = -1
    push(server, 1, torch.ones(4), 1)  # staleness 0: w = -2
    push(server, 2, torch.ones(4), 0)  # staleness 2: lr / 2, w = -2.5
    vector, version = server.pull(0)
    assert version == 3 and torch.allclose(vector, torch.full((4,), -2.5))
    assert server.state.optimizer.lr == 1.0


# --- compression --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_compression_error_feedback_carries_what_rounding_lost(kind):
    torch.manual_seed(0)
    num_params, steps = 1000, 50
    compress = Compressor(kind, num_params, torch.device("cpu"))
    sent, true = torch.zeros(num_params), torch.zeros(num_params)
    for _ in range(steps):
        grads = torch.randn(num_params) * 1e-3 + 1e-6
        message = torch.cat([grads.clone(), torch.tensor([0.5, 2.0])])  # + two buffer values
        wire = compress(message)
        assert wire.dtype == Compressor.DTYPES[kind] and wire.numel() == num_params + 2 * 2  # buffers: float32
        sent += wire[:num_params].float()
        true += grads
    # what was sent plus what is still owed is exactly what was computed
    assert torch.allclose(sent + compress.residual, true, atol=1e-7)
    assert compress.residual.abs().max() < 1e-4


def test_the_ps_takes_a_16_bit_push():
    server = _server("async", workers=1)
    reply = push(server, 1, torch.full((4,), 0.5, dtype=torch.bfloat16), 0)
    assert reply.vector.dtype == torch.float32 and torch.equal(reply.vector, torch.full((4,), -0.5))


# --- real processes ---------------------------------------------------------------

DIGITS = digits(lr=0.1, rpc_timeout=30, seed=3, log_every=1, eval_every=1000)


def _ok(procs):
    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr}"


def _train_records(tmp_path, rank):
    return [r for r in read(tmp_path / "metrics" / f"worker{rank}.jsonl") if r["event"] == "train"]


@pytest.mark.slow
def test_sync_final_parameters_match_one_process_applying_the_averaged_gradients(tmp_path):
    steps, workers, lr, momentum = 6, 2, 0.1, 0.9
    args = DIGITS + ["--strategy", "sync", "--momentum", str(momentum), "--max_steps", str(steps), "--num_epochs", "1"]
    procs = run_cluster(tmp_path, workers=workers, args=args, timeout=120)
    _ok(procs)
    end = read(tmp_path / "metrics" / "ps.jsonl")[-1]
    assert end["pushes"] == {"worker1": steps, "worker2": steps} and end["staleness_max"] == 0
    assert end["step"] == steps  # one update per round
    for rank in (1, 2):
        assert [r["step"] for r in _train_records(tmp_path, rank)] == list(range(1, steps + 1))

    # The same run in one process: each worker's batches, gradients at the same state, averaged.
    train = datasets.load("digits", "", "train", 3)
    ranks = []
    for rank in range(1, workers + 1):
        sampler = datasets.ShardSampler(len(train.data), workers, rank - 1, 3)
        sampler.set_epoch(1)
        loader = datasets.train_loader(train.data, sampler, 32, 0, pin_memory=False)
        model = models.build("cnn", train.channels, train.num_classes, 3)
        model.train()
        ranks.append((FlatModel(model), model, iter(loader)))
    reference = models.build("cnn", train.channels, train.num_classes, 3)
    global_flat = FlatModel(reference, with_grads=False)
    param = nn.Parameter(global_flat.params)
    optimizer = torch.optim.SGD([param], lr=lr, momentum=momentum)
    n = global_flat.num_params
    for _ in range(steps):
        messages = []
        for flat, model, batches in ranks:
            flat.load(global_flat.vector)
            x, y = next(batches)
            flat.zero_grads()
            nn.functional.cross_entropy(model(x), y).backward()
            messages.append(flat.pack_message().clone())
        mean = torch.stack(messages).mean(0)
        param.grad = mean[:n]
        optimizer.step()
        global_flat.vector[n:].copy_(mean[n:])

    final = torch.load(tmp_path / "checkpoints" / "final.pt")
    trained = models.build("cnn", train.channels, train.num_classes, 0)
    trained.load_state_dict(final["model"])
    got = FlatModel(trained, with_grads=False).vector
    assert final["version"] == steps
    assert torch.allclose(got, global_flat.vector, rtol=1e-4, atol=1e-5), (
        f"max difference {(got - global_flat.vector).abs().max():.2e}"
    )


@pytest.mark.slow
def test_ssp_never_lets_a_worker_run_more_than_s_pushes_ahead(tmp_path):
    # worker2 is held back by the test, not by a sleep: it starts only once worker1 has
    # been answered `bound` pushes ahead (its metrics say lead == bound). From then on
    # worker1 must wait for worker2: under async it would push on at once.
    bound = 2
    args = DIGITS + ["--strategy", "ssp", "--staleness", str(bound), "--num_epochs", "2"]
    common = [
        *job_args(tmp_path, 3),
        *args,
    ]
    procs = {"ps": start_app(tmp_path, "ps", ["ps", *common])}
    procs["worker1"] = start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common])
    try:
        deadline = time.monotonic() + 120
        while not any(r.get("lead") == bound for r in _train_records_so_far(tmp_path, 1)):
            ended = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            assert not ended, (ended, (tmp_path / "ps.err").read_text()[-2000:])
            assert time.monotonic() < deadline, "worker1 was not answered at lead == bound within 120 s"
            time.sleep(0.05)
        worker2_started = time.time()
        procs["worker2"] = start_app(tmp_path, "worker2", ["worker", "--rank", "2", *common])
    except BaseException:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        raise
    wait_for(procs, 150)
    _ok({name: finished(tmp_path, name, proc) for name, proc in procs.items()})
    records = {rank: _train_records(tmp_path, rank) for rank in (1, 2)}
    leads = {rank: [r["lead"] for r in records[rank]] for rank in (1, 2)}
    assert max(leads[1] + leads[2]) <= bound
    # worker1 reached the bound alone and was held there until worker2 existed: every
    # answer it got after its first at lead == bound came after worker2 was started.
    at_bound = leads[1].index(bound)
    assert at_bound == bound - 1, leads[1][:10]  # its pushes 1..bound, each 1 more ahead
    assert all(r["time"] >= worker2_started for r in records[1][at_bound + 1 :]), (
        [r["time"] for r in records[1][: bound + 2]],
        worker2_started,
    )
    # Before worker2's first answer, worker1 had at most bound + 1 (the push worker2's first released).
    first2 = records[2][0]["time"]
    assert len([r for r in records[1] if r["time"] < first2]) <= bound + 1
    end = read(tmp_path / "metrics" / "ps.jsonl")[-1]
    # it learned (chance: 0.10); 2 epochs of ssp with a worker held back reach 0.79-0.9 here
    assert end["strategy"] == "ssp" and end["accuracy"] >= 0.70


def _train_records_so_far(tmp_path, rank):
    """worker<rank>'s train records written so far (none before the file exists; a line
    being written is left for the next look)."""
    path = tmp_path / "metrics" / f"worker{rank}.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            break
        if record.get("event") == "train":
            records.append(record)
    return records


@pytest.mark.slow
def test_overlap_and_bf16_compression_still_learn_digits(tmp_path):
    args = DIGITS + ["--overlap", "true", "--compress", "bf16", "--num_epochs", "6", "--log_every", "5"]
    procs = run_cluster(tmp_path, workers=2, args=args, timeout=150)
    _ok(procs)
    end = read(tmp_path / "metrics" / "ps.jsonl")[-1]
    assert end["accuracy"] >= 0.90
    # overlap: every gradient after the first is at least one update late
    staleness = [r["staleness"] for rank in (1, 2) for r in _train_records(tmp_path, rank)]
    assert min(staleness) >= 1
    assert sum(end["pushes"].values()) == end["step"]


def test_overlap_never_writes_a_gradient_into_the_message_still_on_the_wire():

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    intact: list[bool] = []  # each message, once its reply is waited for: as it was sent
    channel = recording_channel(overlap=True)
    sent = channel.push

    def push(outgoing, version, epoch=1, batch=0, samples=0, to_go=-1, epoch_batches=0):
        pending = sent(outgoing, version, epoch, batch, samples, to_go)
        message, copy = outgoing.message, outgoing.message.clone()

        def wait():
            intact.append(torch.equal(message, copy))
            return pending.wait()

        return SimpleNamespace(wait=wait)

    channel.push = push
    trainer = Trainer(parse(["worker", "--overlap", "true"], {}), model, None, None, torch.device("cpu"), channel, None)
    started(trainer)
    for _ in range(5):
        trainer.compute_gradients(torch.randn(8, 3), torch.randint(0, 2, (8,)))
        trainer.push_and_pull()
        on_wire = channel.messages[-1]
        assert all(
            not (on_wire.data_ptr() <= p.grad.data_ptr() < on_wire.data_ptr() + 4 * on_wire.numel())
            for p in model.parameters()
        )  # the next backward lands elsewhere
    trainer.last_reply()
    assert intact == [True] * 5
    pointers = [m.data_ptr() for m in channel.messages]
    assert all(a != b for a, b in zip(pointers, pointers[1:])) and len(set(pointers)) == 2  # two buffers, no copy


@pytest.mark.parametrize("kind,bad", [("bf16", float("nan")), ("fp16", float("inf")), ("fp16", 70000.0)])
def test_a_non_finite_compressed_gradient_is_refused_once_and_leaves_no_residual(kind, bad):
    """One bad gradient (NaN, inf, or a finite value past fp16's 65504) is refused by the PS
    and skipped; the error-feedback residual must not carry it into every later push (it
    did: every push after it was refused, and the worker exited after 20)."""
    n = 6
    server = ps_server(nn.Linear(2, 2), lr=0.1, momentum=0.0, num_trainers=1)
    server.join(1, "worker1")
    compress = Compressor(kind, n, torch.device("cpu"))
    first = torch.tensor([0.1, bad, 0.3, 0.4, 0.5, 0.6])
    refused = push(server, 1, compress(first), 0)
    assert isinstance(refused, Refusal) and refused.kind == "nonfinite" and server.version == 0
    assert torch.equal(compress.residual, torch.zeros(n))
    for step in range(3):
        reply = push(server, 1, compress(torch.full((n,), 0.01 * (step + 1))), 0)
        assert not isinstance(reply, Refusal) and reply.version == step + 1
    assert torch.isfinite(compress.residual).all()


def _displacement(staleness: int) -> float:
    server = ps_server(_linear(1), lr=1.0, momentum=0.9, num_trainers=2, staleness_lr=True)
    for version in range(staleness):
        push(server, 2, torch.zeros(1), version)  # other pushes: the state moves on, not the weights
    push(server, 1, torch.ones(1), 0)
    for _ in range(200):
        push(server, 2, torch.zeros(1), server.version)
    return -server.state.vector.item()


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))


def test_staleness_lr_with_momentum_moves_a_stale_gradient_a_quarter_as_far():
    assert _displacement(4) / _displacement(0) == pytest.approx(0.25, rel=1e-4)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_compressed_pushes_carry_the_buffers_in_float32(kind):
    server = ps_server(_bn_model(), lr=0.1, momentum=0.0, num_trainers=1)
    n = server.state.num_params
    message = torch.zeros(server.state.flat.size)
    message[:n] = 0.5
    message[n:] = torch.tensor([1.0001, 0.3333333, 1.0009, 7.123457])  # not 16-bit values
    buffers = message[n:].clone()
    wire = Compressor(kind, n, torch.device("cpu"))(message)
    reply = push(server, 1, wire, 0)
    assert torch.equal(reply.vector[n:], buffers)
