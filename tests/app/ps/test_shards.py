"""A PS sharded across K processes (app/ps/sharding/slices.py): slicing, sliced servers, a real cluster."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from app.checkpoint import files as checkpoint_files
from app.checkpoint.writer import Checkpointer
from app.config import UsageError, parse
from app.ps.server import ParameterServer
from app.ps.sharding import slices as shards
from app.training import models
from app.training.flat import state_size
from app.training.metrics import MetricsWriter, read
from app.worker.compress import Compressor

import app_testkit as testkit
from app_testkit import ps_server, push, run_cluster, submit


@pytest.mark.parametrize("size,k", [(10, 1), (10, 3), (11, 2), (7, 7), (3, 5), (0, 2), (11_689_512, 8)])
def test_bounds_are_contiguous_balanced_and_cover_everything(size, k):
    parts = shards.bounds(size, k)
    assert len(parts) == k and parts[0][0] == 0 and parts[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    lengths = [end - start for start, end in parts]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


def test_bounds_refuse_zero_shards():
    with pytest.raises(ValueError):
        shards.bounds(4, 0)


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3), nn.BatchNorm1d(3))


def _servers(strategy: str, k: int, workers: int = 2) -> tuple[ParameterServer, list[ParameterServer]]:
    kw = dict(lr=0.1, momentum=0.9, num_trainers=workers, strategy=strategy)
    whole = ps_server(_model(), **kw)
    parts = shards.bounds(whole.state.flat.size, k)
    sliced = [ps_server(_model(), part=part, **kw) for part in parts]
    for server in [whole, *sliced]:
        for rank in range(1, workers + 1):
            server.join(rank, f"worker{rank}")
    return whole, sliced


@pytest.mark.parametrize("k", [2, 3, 5, 40])  # 40: slices of buffers only, of a few values
def test_sharded_async_pushes_give_exactly_the_unsliced_vector(k):
    whole, sliced = _servers("async", k)
    assert whole.state.flat.num_buffers > 0 and sum(s.state.num_params for s in sliced) == whole.state.flat.num_params
    assert any(s.state.num_params == 0 for s in sliced) == (k >= 5)  # 53 parameter values of 67
    generator = torch.Generator().manual_seed(0)
    for step in range(12):
        rank = 1 + step % 2
        message = torch.randn(whole.state.flat.size, generator=generator)
        expected = push(whole, rank, message, step).vector
        replies = [push(s, rank, message[s.state.part[0] : s.state.part[1]].clone(), step) for s in sliced]
        assert torch.equal(torch.cat([r.vector for r in replies]), expected)
        assert {r.version for r in replies} == {step + 1}
    assert torch.equal(torch.cat([s.pull(0)[0] for s in sliced]), whole.state.flat.vector)


@pytest.mark.parametrize("k", [2, 3])
def test_sharded_sync_rounds_give_exactly_the_unsliced_vector(k):
    whole, sliced = _servers("sync", k)
    generator = torch.Generator().manual_seed(1)
    for round_ in range(4):
        messages = {rank: torch.randn(whole.state.flat.size, generator=generator) for rank in (1, 2)}
        futures = {rank: submit(whole, rank, m, round_) for rank, m in messages.items()}
        parts = {
            rank: [submit(s, rank, m[s.state.part[0] : s.state.part[1]].clone(), round_) for s in sliced]
            for rank, m in messages.items()
        }
        expected = futures[1].wait().vector
        for rank in (1, 2):
            assert torch.equal(torch.cat([f.wait().vector for f in parts[rank]]), expected)
    # a drop forwarded to every shard closes rounds without the dropped rank
    for server in [whole, *sliced]:
        server.drop(2, "worker2")
    message = torch.randn(whole.state.flat.size, generator=generator)
    expected = push(whole, 1, message, 4).vector
    got = torch.cat([push(s, 1, message[s.state.part[0] : s.state.part[1]].clone(), 4).vector for s in sliced])
    assert torch.equal(got, expected)


def test_a_shard_refuses_a_push_of_the_whole_vector():
    _, sliced = _servers("async", 2)
    with pytest.raises(ValueError, match=r"worker1 pushed \d+ .* values \d+\.\.\d+ of the model"):
        push(sliced[1], 1, torch.ones(sliced[1].state.flat.size), 0)


def test_a_shards_checkpoint_holds_its_slice_and_restores_only_into_the_same_slice():
    _, sliced = _servers("async", 3)
    shard = sliced[1]
    push(shard, 1, torch.ones(shard.state.size), 0)
    state = shard.checkpoint()
    assert state["model"] == {} and state["part"] == list(shard.state.part)
    assert state["vector"].numel() == shard.state.size
    fresh = ps_server(_model(), lr=0.1, momentum=0.9, num_trainers=2, part=shard.state.part)
    fresh.restore(state)
    assert fresh.version == 1 and torch.equal(fresh.state.vector, shard.state.vector)
    assert torch.equal(
        fresh.state.optimizer.state_dict()["state"][0]["momentum_buffer"],
        shard.state.optimizer.state_dict()["state"][0]["momentum_buffer"],
    )
    other = ps_server(_model(), lr=0.1, momentum=0.9, num_trainers=2, part=sliced[2].state.part)
    with pytest.raises(ValueError, match="this shard"):
        other.restore(state)


def test_one_shard_is_the_unsliced_server():
    server = ps_server(
        models.build("cnn", 1, 10, seed=0),
        lr=0.1,
        momentum=0.0,
        num_trainers=1,
        part=(0, state_size(models.build("cnn", 1, 10, seed=0))),
    )
    assert not server.state.sliced and server.state.vector is server.state.flat.vector


def test_shard_flags():
    config = parse(["ps", "--shards", "3", "--shard", "2"], {})
    assert (config.shards, config.shard, config.name) == (3, 2, "ps2")
    assert parse(["worker", "--world_size", "3"], {"PSC_SHARDS": "2"}).shards == 2
    for argv, match in [
        (["ps", "--shards", "2", "--shard", "2"], "--shard: 2"),
        (["worker", "--shards", "2", "--shard", "1"], "--shard: 1 is for the ps role"),
        (["ps", "--shards", "9"], "--shards: 9 must be <= 8"),
        (["ps", "--shards", "0"], "--shards: 0 must be >= 1"),
        (["ps", "--shards", "2", "--strategy", "allreduce"], "allreduce has none"),
    ]:
        with pytest.raises(UsageError, match=match):
            parse(argv, {})


def _main_ps(tmp_path, shards: int):
    """A main PS's config and its session in the job's transport, whose store it holds."""
    from app.exchange import transport

    secret = testkit.secret_file(tmp_path)
    config = parse(
        ["ps", "--shards", str(shards), "--secret_file", str(secret), "--socket_dir", str(tmp_path / "sockets")], {}
    )
    return config, transport.session(config, 0)


def test_the_main_ps_opens_the_workers_join_window_each_time_every_shard_is_up(tmp_path):
    """Workers cannot join before every shard is up (NotReady), so the join window opens then:
    once when the last shard registers, again when a lost one registers anew."""
    from app.exchange import transport
    from app.exchange.group import READY_KEY
    from app.ps.sharding.shardset import ShardSet

    config, session = _main_ps(tmp_path, 3)
    with session:
        store = transport.own_store(config, 10)
        opened: list[int] = []
        others = ShardSet(3, 30, config, lambda *args, **fields: None, on_ready=lambda: opened.append(len(opened)))
        assert others.register(1, "ps1", 3, others.bounds[1]) is None
        assert opened == [] and not store.check([READY_KEY])
        assert others.register(2, "ps2", 3, others.bounds[2]) is None
        assert opened == [0] and store.check([READY_KEY])
        assert others.register(2, "ps2_r2", 3, others.bounds[2]) is None  # a lost shard, started again
        assert opened == [0, 1]


def test_the_main_ps_closes_the_workers_join_window_when_it_loses_a_shard(tmp_path):
    """A lost shard: READY_KEY is gone and workers cannot join until it is back, so their
    join_timeout stops running until it registers again."""
    from app.exchange import transport
    from app.exchange.group import READY_KEY
    from app.ps.sharding.shardset import ShardSet

    config, session = _main_ps(tmp_path, 2)
    with session:
        store = transport.own_store(config, 10)
        window: list[str] = []
        others = ShardSet(
            2, 20, config, lambda *args, **fields: None, lambda: window.append("open"), lambda: window.append("closed")
        )
        assert others.register(1, "ps1", 2, others.bounds[1]) is None
        others._lost(1, "ps1", "it did not answer a ping")
        assert window == ["open", "closed"] and not store.check([READY_KEY])
        others._lost(1, "ps1", "a second report of the same loss")  # no longer its shard: nothing changes
        assert window == ["open", "closed"]
        assert others.register(1, "ps1_r2", 2, others.bounds[1]) is None
        assert window == ["open", "closed", "open"] and store.check([READY_KEY])


DIGITS = [*testkit.DIGITS, "--momentum", "0.5", "--checkpoint_every", "200"]


@pytest.mark.slow
def test_ps_and_one_shard_and_two_workers_learn_digits(tmp_path):
    procs = run_cluster(tmp_path, workers=2, args=DIGITS + ["--shards", "2"], timeout=300, shards=2)

    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr}"
    assert set(procs) == {"ps", "ps1", "worker1", "worker2"}
    lines = [line for line in procs["ps"].stdout.splitlines() if line.startswith("Accuracy: ")]
    assert len(lines) == 1 and float(lines[0].split()[1]) >= 0.90, procs["ps"].stdout
    # The PS evaluates the gathered vector once its version reaches 100 (--eval_every), as
    # of the snapshot it takes then: pushes landing meanwhile may put it a few past 100.
    evals = [int(m) for m in re.findall(r"^ps \| Update: (\d+) \| Accuracy: ", procs["ps"].stdout, re.M)]
    assert evals and 100 <= evals[0] < 200, procs["ps"].stdout
    metrics = tmp_path / "metrics"
    end = read(metrics / "ps.jsonl")[-1]
    shard_end = read(metrics / "ps1.jsonl")[-1]
    pushes = sum(read(metrics / f"worker{r}.jsonl")[-1]["step"] for r in (1, 2))
    assert end["event"] == shard_end["event"] == "end" and end["step"] == shard_end["step"] == pushes
    final = torch.load(tmp_path / "checkpoints" / "final.pt")
    model = models.build("cnn", 1, 10, seed=0)
    model.load_state_dict(final["model"])  # the whole model, every shard's values
    trained = torch.nn.utils.parameters_to_vector(model.parameters())
    initial = torch.nn.utils.parameters_to_vector(models.build("cnn", 1, 10, seed=1).parameters())
    (_, start), (_, end) = shards.bounds(trained.numel(), 2)  # cnn: parameters only
    assert not torch.equal(trained[start:end], initial[start:end])  # shard 1's trained values
    assert final["shards"] == 2 and "vector" not in final
    shard_checkpoints = list((tmp_path / "checkpoints" / "shard1").glob("ckpt-*.pt"))
    assert shard_checkpoints, "the shard wrote no checkpoint"


@pytest.mark.slow
def test_sync_with_two_shards_applies_the_same_rounds_on_every_shard(tmp_path):
    args = DIGITS[:-2] + ["--num_epochs", "2", "--strategy", "sync", "--shards", "3", "--checkpoint_every", "0"]
    procs = run_cluster(tmp_path, workers=2, args=args, timeout=300, shards=3)

    assert {p.name: p.returncode for p in procs.values()} == {"ps": 0, "ps1": 0, "ps2": 0, "worker1": 0, "worker2": 0}
    metrics = tmp_path / "metrics"
    ends = [read(metrics / f"{name}.jsonl")[-1] for name in ("ps", "ps1", "ps2")]
    pushes = [read(metrics / f"worker{r}.jsonl")[-1]["step"] for r in (1, 2)]
    assert pushes[0] == pushes[1] > 0
    assert {e["step"] for e in ends} == {pushes[0]}  # one update per round, on every shard
    assert all(e["staleness_max"] == 0 for e in ends)


def _linear(size: int, value: float = 0.0) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.constant_(model.weight, value)
    return model


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))


def test_a_shard_takes_the_staleness_the_main_ps_computed():
    whole = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, staleness_lr=True)
    shard = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, staleness_lr=True, part=(2, 4))
    for server in (whole, shard):
        push(server, 2, torch.zeros(server.state.size), 0)
        push(server, 2, torch.zeros(server.state.size), 1)
    reply = push(whole, 1, torch.ones(4), 0)  # staleness 2 on the main PS
    # the shard got rank 1's push before rank 2's: by its own count the push is fresh
    fresh = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, staleness_lr=True, part=(2, 4))
    got = push(fresh, 1, torch.ones(2), 0, staleness=reply.staleness)
    assert got.staleness == reply.staleness == 2
    assert torch.equal(got.vector, reply.vector[2:4])


def test_a_compressed_push_to_a_shard_straddling_params_and_buffers_decodes():
    whole = ps_server(_bn_model(), lr=0.1, momentum=0.0, num_trainers=1)
    n, size = whole.state.num_params, whole.state.flat.size
    message = torch.arange(size, dtype=torch.float32) / 7 + 1
    expected = message[n:].clone()
    wire = Compressor("bf16", n, torch.device("cpu"))(message)
    start, end = n - 2, size
    shard = ps_server(_bn_model(), lr=0.1, momentum=0.0, num_trainers=1, part=(start, end))
    reply = push(shard, 1, Compressor.slice(wire, n, start, end), 0)
    assert torch.equal(reply.vector[2:], expected)


def test_the_main_ps_writes_no_checkpoint_unless_every_shard_wrote_its_partner(tmp_path):
    config = parse(["ps", "--checkpoint_dir", str(tmp_path), "--checkpoint_every", "1"], {})
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=1)
    asked = []

    def shard_fails(version: int) -> None:
        asked.append(version)
        raise RuntimeError("ps1 did not write its checkpoint labelled 1: disk full")

    with MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0) as metrics:
        checkpoints = Checkpointer(server, config, {}, metrics)
        checkpoints.before_save = shard_fails
        push(server, 1, torch.ones(4), 0)
        checkpoints.save("every 1 updates")
        assert asked == [1] and checkpoint_files.listing(tmp_path) == []
        checkpoints.before_save = asked.append
        push(server, 1, torch.ones(4), 1)
        checkpoints.save("every 1 updates")
    assert asked == [1, 2] and [checkpoint_files.verify(p)["version"] for p in checkpoint_files.listing(tmp_path)] == [
        2
    ]


def test_a_shard_resumes_from_its_checkpoint_labelled_with_the_main_ps_version(tmp_path):
    from app.ps.sharding.shard_process import resume_shard

    shard = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=1, part=(2, 4))
    for label in (1, 2, 3):  # the shard wrote 3; the main PS crashed before writing its own
        push(shard, 1, torch.ones(2), shard.version)
        checkpoint_files.save({**shard.checkpoint(), "label": label}, tmp_path)
    restarted = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=1, part=(2, 4))
    assert "labelled" not in resume_shard(restarted, tmp_path, None)
    assert restarted.version == 0
    resume_shard(restarted, tmp_path, 2)  # the main PS resumed from its version 2
    assert restarted.version == 2 and torch.equal(restarted.state.vector, torch.full((2,), -2.0))
    with pytest.raises(RuntimeError, match="no checkpoint labelled 7"):
        resume_shard(restarted, tmp_path, 7)
