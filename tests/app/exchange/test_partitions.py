"""A push applied partition by partition as the worker's backward finishes them
(app.exchange.layout, app.exchange.notes, app.exchange.early_push, app.ps.early)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from app.exchange.early_push import EarlyPush
from app.exchange.layout import cut, owners
from app.exchange.notes import Note, NoteInbox, NoteSender
from app.exchange.ps_end import SharedExchange
from app.exchange.segment import sweep
from app.exchange.wire import Refusal
from app.exchange.worker_end import WorkerEnd
from app.training.flat import FlatModel

from app_testkit import digits, ps_server, push, submit


@pytest.fixture
def shm_dir(tmp_path):
    path = Path("/dev/shm") / f"test-psc-{os.getpid()}-{tmp_path.name}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)  # a PS's sweep may have taken it once it was empty a while


def test_partitions_are_cut_at_parameter_boundaries_and_the_last_holds_the_buffers():
    assert cut([5, 5, 20, 3], 40, 8) == [(0, 10), (10, 30), (30, 40)]  # 3 params + 7 buffer values last
    assert owners([5, 5, 20, 3], [(0, 10), (10, 30), (30, 40)]) == [0, 0, 1, 2]
    assert cut([100], 100, 8) == [(0, 100)]  # a parameter larger than the target is a partition of its own
    assert cut([5, 5], 12, 100) == [(0, 12)]  # a small model: one partition, nothing goes ahead
    assert cut([4, 4], 8, 4) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError):
        cut([5], 4, 8)


class Deep(nn.Module):
    """Four linear layers and a BatchNorm: four parameter tensors of 64 x 64, and buffers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(4)], nn.BatchNorm1d(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Collect(NoteSender):
    """A NoteSender of rank `rank` in its first life that keeps its notes instead of sending them."""

    def __init__(self, rank: int = 1) -> None:
        self.rank, self.life = rank, 1
        self.notes: list[Note] = []

    def send(self, note: Note) -> None:
        self.notes.append(note)


def _backward(model: nn.Module, poster: EarlyPush, backward: int) -> bool:
    poster.arm(backward, 0, 7)
    model(torch.randn(16, 64)).pow(2).sum().backward()
    return poster.claims()


def test_the_backward_notes_its_partitions_last_layers_first_and_never_the_last_one():
    model = Deep()
    params = list(model.parameters())
    flat = FlatModel(model)
    parts = cut([p.numel() for p in params], flat.size, 64 * 64)  # one linear layer each
    sender = Collect(3)
    poster = EarlyPush(params, parts, sender, "worker3", [flat.message])
    assert len(parts) == 5  # 4 linears, then the BatchNorm's parameters with its buffers
    assert _backward(model, poster, 0) is False and sender.notes == []  # the first backward only counts
    assert _backward(model, poster, 1) is True
    # the backward finishes the last linear first; partition 4 (the first layers' side: here the
    # BatchNorm, which is last) goes with the push
    assert [n.partition for n in sender.notes] == [3, 2, 1, 0]
    assert {(n.rank, n.backward, n.slot, n.version, n.life) for n in sender.notes} == {(3, 1, 0, 7, 1)}


def test_a_partition_with_a_nan_or_inf_in_its_slot_is_not_noted():
    """A note says the partition is finite: the PS does not check it again, so one that is not
    goes with the push, where the PS checks it and refuses the push."""
    model = Deep()
    params = list(model.parameters())
    flat = FlatModel(model)
    parts = cut([p.numel() for p in params], flat.size, 64 * 64)
    sender = Collect()
    poster = EarlyPush(params, parts, sender, "worker1", [flat.message])
    _backward(model, poster, 0)
    model.layers[1].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([5]), float("inf")))
    flat.zero_grads()
    assert _backward(model, poster, 1) is True
    assert [n.partition for n in sender.notes] == [3, 2, 0] and poster.unfinite == 1


def test_a_weight_used_twice_is_noted_once_its_whole_gradient_is_in():
    """Autograd sums a shared weight's two contributions before it accumulates them: its hook
    fires once, with the whole gradient."""
    layer = nn.Linear(64, 64, bias=False)
    model = nn.Sequential(layer, nn.ReLU(), layer, nn.Linear(64, 64, bias=False))
    params = list(model.parameters())
    flat = FlatModel(model)
    parts = cut([p.numel() for p in params], flat.size, 64 * 64)
    sender = Collect()
    poster = EarlyPush(params, parts, sender, "worker1", [flat.message])
    assert _backward(model, poster, 0) is False
    assert _backward(model, poster, 1) is True and [n.partition for n in sender.notes] == [0]


class Unused(nn.Module):
    """A parameter the forward never uses: its gradient never comes."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_parameter_whose_gradient_never_comes_turns_the_notes_off():
    model = Unused()
    params = list(model.parameters())
    flat = FlatModel(model)
    parts = cut([p.numel() for p in params], flat.size, 64)
    sender = Collect()
    poster = EarlyPush(params, parts, sender, "worker1", [flat.message])
    assert _backward(model, poster, 0) is False
    assert _backward(model, poster, 1) is False and sender.notes == []


def test_the_bell_carries_a_note_and_a_dead_ps_bell_is_swept(shm_dir):
    notes = NoteInbox(str(shm_dir / "psc-1-abc.notes"))
    sender = NoteSender(notes.path, 2, 1)
    sender.note_partition(5, 1, 3, 40)
    assert notes.receive() == Note(2, 5, 1, 3, 40, 1)
    assert notes.receive() is None  # nothing more: it waits its timeout and says so
    notes.sock.close()  # the PS died: its socket file stays, its segment is gone
    assert sweep(str(shm_dir)) == [notes.path] and list(shm_dir.iterdir()) == []
    sender.note_partition(6, 1, 3, 41)  # noting to a PS that is gone is no error
    assert sender.dropped == 1


def test_a_gpu_workers_forward_waits_only_for_the_partitions_each_module_needs():
    """app.exchange.ordered_pull: a module waits for the partitions its own parameters are in (and the
    buffers, copied first, when it has some); the first layer never for the last partition."""
    from app.exchange.ordered_pull import waits

    model = Deep()
    parts = cut([p.numel() for p in model.parameters()], FlatModel(model).size, 64 * 64)
    got = {name: waits(model, parts).get(module) for name, module in model.named_modules()}
    assert got["layers.0"] == ([0], False) and got["layers.3"] == ([3], False)
    assert got["layers.4"] == ([4], True)  # the BatchNorm: its parameters in the last partition, and buffers
    assert got[""] is None and got["layers"] is None  # containers have nothing of their own


# --- the PS: partitions applied ahead of the push ------------------------------------------------


def _ps(shm_dir: Path, strategy: str, workers: int = 1, momentum: float = 0.0, overlap: bool = False):
    model = Deep()
    flat = FlatModel(model, with_grads=False)
    parts = cut([p.numel() for p in model.parameters()], flat.size, 64 * 64)
    exchange = SharedExchange.open(
        str(shm_dir), flat.size, workers, overlap=overlap, sync=strategy == "sync", parts=parts
    )
    server = ps_server(
        model, lr=0.1, momentum=momentum, num_trainers=workers, strategy=strategy, shared=exchange, overlap=overlap
    )
    return server, exchange


def _push(server, exchange, link, rank, gradient, version, backward, noted_parts, noted=True):
    """Write `gradient` into rank's slot, note `noted_parts`, push; the answer."""
    link.slots[0][: gradient.numel()].copy_(gradient)
    for j in noted_parts:
        server.note(Note(rank, backward, 0, j, version, 1))
    pushed = exchange.push(rank, 0, "float32", gradient.numel())
    return submit(server, rank, pushed, version, f"worker{rank}", backward=backward, noted=noted).wait()


def test_async_partitions_applied_ahead_give_the_same_state_as_the_push_whole(shm_dir):
    server, exchange = _ps(shm_dir, "async")
    whole, whole_exchange = _ps(shm_dir, "async")
    try:
        link = WorkerEnd.attach(exchange.offer(), 1, torch.device("cpu"))
        for s in (server, whole):
            s.join(1, "worker1")
        _push(server, exchange, link, 1, torch.zeros(server.state.size), 0, 0, [], noted=False)  # the first backward
        push(whole, 1, torch.zeros(whole.state.size), 0)
        torch.manual_seed(1)
        for step in range(1, 4):
            gradient = torch.randn(server.state.size)
            reply = _push(server, exchange, link, 1, gradient, step, step, [3, 2, 1, 0])
            assert torch.equal(link.reply(exchange.answer(reply)).vector, push(whole, 1, gradient.clone(), step).vector)
        assert server.counts.early_done == server.counts.early_kept == 12
    finally:
        exchange.close()
        whole_exchange.close()


@contextlib.contextmanager
def _two_ranks(shm_dir: Path, overlap: bool = False):
    """An async PS of ranks 1 and 2 with partitions (workers that --overlap or not), the same PS
    taking every push whole, and the two ranks' links; both PS know both ranks."""
    server, exchange = _ps(shm_dir, "async", workers=2, overlap=overlap)
    whole, whole_exchange = _ps(shm_dir, "async", workers=2)
    try:
        links = [WorkerEnd.attach(exchange.offer(), r, torch.device("cpu")) for r in (1, 2)]
        for s in (server, whole):
            s.join(1, "worker1")
            s.join(2, "worker2")
        yield server, exchange, whole, links
    finally:
        exchange.close()
        whole_exchange.close()


def test_a_partition_built_before_another_push_moved_the_state_is_built_again(shm_dir):
    with _two_ranks(shm_dir) as (server, exchange, whole, (one, two)):
        torch.manual_seed(2)
        a, b = torch.randn(server.state.size), torch.randn(server.state.size)
        one.slots[0][: a.numel()].copy_(a)
        server.note(Note(1, 0, 0, 3, 0, 1))  # worker1's partition 3, built from version 0 ...
        _push(server, exchange, two, 2, b, 0, 0, [], noted=False)  # ... then worker2's push moves the state
        server.note(Note(1, 0, 0, 2, 0, 1))  # partition 2 built from version 1
        got = _push(server, exchange, one, 1, a, 0, 0, [])
        push(whole, 2, b.clone(), 0)
        want = push(whole, 1, a.clone(), 0)
        assert torch.equal(one.reply(exchange.answer(got)).vector, want.vector)
        assert server.counts.early_kept == 1  # partition 2; partition 3 was built again


def test_under_overlap_async_builds_nothing_ahead_and_checks_no_noted_partition_again(shm_dir):
    """Workers that overlap do not wait for what is built ahead: their notes only say which
    partitions were checked, and the push is built whole when it arrives, to the same values."""
    with _two_ranks(shm_dir, overlap=True) as (server, exchange, whole, (one, two)):
        _push(server, exchange, one, 1, torch.zeros(server.state.size), 0, 0, [], noted=False)  # the first backward
        push(whole, 1, torch.zeros(whole.state.size), 0)
        torch.manual_seed(3)
        a, b = torch.randn(server.state.size), torch.randn(server.state.size)
        one.slots[0][: a.numel()].copy_(a)
        for j in (3, 2):
            server.note(Note(1, 1, 0, j, 1, 1))
        _push(server, exchange, two, 2, b, 1, 0, [], noted=False)  # another rank's push lands between
        server.note(Note(1, 1, 0, 1, 2, 1))
        one.slots[0][64 * 64 * 3 : 64 * 64 * 4] = float("nan")  # after its note: not checked again
        pushed = exchange.push(1, 0, "float32", a.numel())
        got = submit(server, 1, pushed, 1, "worker1", backward=1, noted=True).wait()
        assert not isinstance(got, Refusal) and server.version == 3
        assert server.counts.early_done == 0  # nothing was built before the push
        assert server.counts.early_checked == 3  # the three noted partitions were not read
        push(whole, 2, b.clone(), 1)
        want = push(whole, 1, a, 1).vector
        state = one.reply(exchange.answer(got)).vector
        rest = torch.cat([torch.arange(0, 64 * 64 * 3), torch.arange(64 * 64 * 4, server.state.size)])
        assert torch.equal(state[rest], want[rest])  # the push built whole, from the state it met
        assert torch.isnan(state[64 * 64 * 3 : 64 * 64 * 4]).all()


def test_under_overlap_notes_of_a_backward_count_while_the_push_before_it_is_still_on_the_wire(shm_dir):
    """A worker that overlaps notes backward 2's partitions (in its other slot) before its push
    from backward 1 is taken: they are kept, and push 2 does not read them again."""
    with _two_ranks(shm_dir, overlap=True) as (server, exchange, whole, (one, two)):
        _push(server, exchange, one, 1, torch.zeros(server.state.size), 0, 0, [], noted=False)  # the first backward
        push(whole, 1, torch.zeros(whole.state.size), 0)
        torch.manual_seed(5)
        a, b = torch.randn(server.state.size), torch.randn(server.state.size)
        one.slots[0][: a.numel()].copy_(a)  # push 1 on the wire from slot 0 ...
        one.slots[1][: b.numel()].copy_(b)  # ... while backward 2 writes slot 1 and notes it
        for j in (3, 2, 1, 0):
            server.note(Note(1, 2, 1, j, 1, 1))
        first = submit(server, 1, exchange.push(1, 0, "float32", a.numel()), 1, "worker1", backward=1, noted=False)
        assert not isinstance(first.wait(), Refusal)
        one.slots[1][64 * 64 * 3 : 64 * 64 * 4] = float("nan")  # after its note: not read again
        pushed = exchange.push(1, 1, "float32", b.numel())
        got = submit(server, 1, pushed, 2, "worker1", backward=2, noted=True).wait()
        assert not isinstance(got, Refusal) and server.version == 3
        assert server.counts.early_checked == 4 and server.counts.early_done == 0
        push(whole, 1, a, 1)
        want = push(whole, 1, b, 2).vector
        state = one.reply(exchange.answer(got)).vector
        rest = torch.cat([torch.arange(0, 64 * 64 * 3), torch.arange(64 * 64 * 4, server.state.size)])
        assert torch.equal(state[rest], want[rest])
        assert torch.isnan(state[64 * 64 * 3 : 64 * 64 * 4]).all()


def test_a_replaced_processs_late_note_does_not_vouch_for_the_new_process_partition(shm_dir):
    """A note carries its process's life at the PS (which of the rank's joins it is). The old
    process of rank 1 noted partition 2 of its backward 2 and died; read after a new process
    joined and pushed twice, that note is passed over: the new process's push from its
    backward 2, with a NaN in partition 2, is checked there and refused."""
    with _two_ranks(shm_dir, overlap=True) as (server, exchange, whole, (one, two)):
        joined = server.join(1, "worker1_r2")
        assert joined.life == 2 and WorkerEnd.attach(exchange.offer(joined.life), 1, torch.device("cpu")).life == 2
        for backward in (0, 1):
            pushed = exchange.push(1, 0, "float32", server.state.size)
            got = submit(server, 1, pushed, backward, "worker1_r2", backward=backward, noted=False).wait()
            assert not isinstance(got, Refusal)
        gradient = torch.ones(server.state.size)
        gradient[64 * 64 * 2 + 5] = float("nan")
        one.slots[0][: gradient.numel()].copy_(gradient)
        server.note(Note(1, 2, 0, 2, 1, 1))  # the old process's note, late
        server.note(Note(1, 2, 0, 3, 2, 2))  # the new process's own
        pushed = exchange.push(1, 0, "float32", gradient.numel())
        got = submit(server, 1, pushed, 2, "worker1_r2", backward=2, noted=True).wait()
        assert isinstance(got, Refusal) and got.kind == "nonfinite"
        assert server.counts.early_checked == 0 and server.version == 2


@pytest.mark.parametrize("strategy", ["async", "sync"])
def test_a_non_finite_partition_the_worker_did_not_note_refuses_the_whole_push(shm_dir, strategy):
    """The others were noted (and built or folded ahead): the PS checks what was not."""
    server, exchange = _ps(shm_dir, strategy)
    try:
        link = WorkerEnd.attach(exchange.offer(), 1, torch.device("cpu"))
        server.join(1, "worker1")
        _push(server, exchange, link, 1, torch.zeros(server.state.size), 0, 0, [], noted=False)  # the first backward
        before = server.snapshot()[0]
        gradient = torch.ones(server.state.size)
        gradient[64 * 64 * 2 + 5] = float("nan")  # in partition 2, which its worker did not note
        answer = _push(server, exchange, link, 1, gradient, 1, 1, [3, 1, 0])
        assert isinstance(answer, Refusal) and answer.kind == "nonfinite"
        assert torch.equal(server.snapshot()[0], before) and server.version == 1
        assert server.counts.early_done == 3  # the noted ones were taken ahead, and are not read again
    finally:
        exchange.close()


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_sync_partitions_folded_ahead_close_the_round_as_the_pushes_whole(shm_dir, momentum):
    server, exchange = _ps(shm_dir, "sync", workers=2, momentum=momentum)
    whole, whole_exchange = _ps(shm_dir, "sync", workers=2, momentum=momentum)
    try:
        links = {r: WorkerEnd.attach(exchange.offer(), r, torch.device("cpu")) for r in (1, 2)}
        for s in (server, whole):
            s.join(1, "worker1")
            s.join(2, "worker2")
        torch.manual_seed(3)
        a, b = torch.randn(server.state.size), torch.randn(server.state.size)
        links[1].slots[0][: a.numel()].copy_(a)
        links[2].slots[0][: b.numel()].copy_(b)
        # both workers' backwards overlap: their notes come interleaved, worker1 folds first everywhere
        for j in (3, 2, 1, 0):
            server.note(Note(1, 0, 0, j, 0, 1))
            server.note(Note(2, 0, 0, j, 0, 1))
        held = submit(server, 1, exchange.push(1, 0, "float32", a.numel()), 0, "worker1", backward=0, noted=True)
        submit(server, 2, exchange.push(2, 0, "float32", b.numel()), 0, "worker2", backward=0, noted=True).wait()
        want = submit(whole, 1, a.clone(), 0, "worker1")
        submit(whole, 2, b.clone(), 0, "worker2").wait()
        assert torch.equal(links[1].reply(exchange.answer(held.wait())).vector, want.wait().vector)
        assert server.counts.early_kept == 8  # each push found its four partitions folded
    finally:
        exchange.close()
        whole_exchange.close()


def test_a_new_process_of_a_rank_folds_its_push_whole_after_its_old_ones_notes(shm_dir):
    server, exchange = _ps(shm_dir, "sync", workers=2, momentum=0.5)
    whole, whole_exchange = _ps(shm_dir, "sync", workers=2, momentum=0.5)
    try:
        links = {r: WorkerEnd.attach(exchange.offer(), r, torch.device("cpu")) for r in (1, 2)}
        for s in (server, whole):
            s.join(1, "worker1")
            s.join(2, "worker2")
        torch.manual_seed(4)
        old, a, b = torch.randn(server.state.size), torch.randn(server.state.size), torch.randn(server.state.size)
        links[1].slots[0][: old.numel()].copy_(old)
        server.note(Note(1, 0, 0, 3, 0, 1))  # the old process of rank 1 noted a partition, then died
        server.join(1, "worker1_r2")
        whole.join(1, "worker1_r2")
        links[1].slots[0][: a.numel()].copy_(a)
        held = submit(server, 1, exchange.push(1, 0, "float32", a.numel()), 0, "worker1_r2", backward=0, noted=True)
        links[2].slots[0][: b.numel()].copy_(b)
        submit(server, 2, exchange.push(2, 0, "float32", b.numel()), 0, "worker2").wait()
        want = submit(whole, 1, a.clone(), 0, "worker1_r2")
        submit(whole, 2, b.clone(), 0, "worker2").wait()
        assert torch.equal(links[1].reply(exchange.answer(held.wait())).vector, want.wait().vector)
    finally:
        exchange.close()
        whole_exchange.close()


# --- real processes ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "workers,args",
    [(1, ["--strategy", "async"]), (2, ["--strategy", "sync", "--momentum", "0.5"]), (1, ["--overlap", "true"])],
    ids=["async", "sync", "overlap"],
)
def test_processes_apply_partitions_ahead_to_the_same_values_as_tensorpipe(tmp_path, shm_dir, workers, args):
    """The cnn on digits in partitions of 2000 values: the PS applies them as the backward
    finishes them, or under --overlap takes them as checked (its end record counts them), and
    final.pt is the same bits as the same run over TensorPipe."""
    from app_testkit import app_env, run_cluster

    job = digits(lr=0.1, seed=1)
    finals, ends = {}, {}
    for mode in ("auto", "tensorpipe"):
        run = tmp_path / mode
        run.mkdir()
        common = [*job, "--num_epochs", "2", "--rpc_timeout", "30", "--exchange", mode, "--partition_values", "2000"]
        procs = run_cluster(run, workers, [*common, *args], 240, env=app_env(PSC_SHM_DIR=str(shm_dir)))
        assert all(p.returncode == 0 for p in procs.values()), {n: p.stderr[-2000:] for n, p in procs.items()}
        finals[mode] = torch.load(run / "checkpoints" / "final.pt")
        ends[mode] = [json.loads(line) for line in (run / "metrics" / "ps.jsonl").read_text().splitlines()][-1]
    assert "ahead" not in ends["tensorpipe"]
    ahead = ends["auto"]["ahead"]
    if "--overlap" in args:  # nothing built ahead: the push reads only what was not noted
        assert ahead["done"] == 0 and ahead["checked"] > 0, ahead
    else:
        assert ahead["kept"] > 0 and ahead["done"] >= ahead["kept"] and ahead["checked"] > 0, ahead
    assert finals["auto"]["version"] == finals["tensorpipe"]["version"] > 0
    for key, value in finals["auto"]["model"].items():
        assert torch.equal(value, finals["tensorpipe"]["model"][key]), key


def test_the_ps_does_not_read_a_partition_noted_ahead_again(shm_dir):
    """Its worker checked it before noting it: once built ahead, the push takes it as built (what
    lies in the slot afterwards is not read), and only the rest is checked and applied."""
    server, exchange = _ps(shm_dir, "async")
    whole, whole_exchange = _ps(shm_dir, "async")
    try:
        link = WorkerEnd.attach(exchange.offer(), 1, torch.device("cpu"))
        for s in (server, whole):
            s.join(1, "worker1")
        _push(server, exchange, link, 1, torch.zeros(server.state.size), 0, 0, [], noted=False)
        push(whole, 1, torch.zeros(whole.state.size), 0)
        gradient = torch.randn(server.state.size)
        link.slots[0][: gradient.numel()].copy_(gradient)
        for j in (3, 2, 1, 0):
            server.note(Note(1, 1, 0, j, 1, 1))
        link.slots[0][64 * 64 * 3 : 64 * 64 * 4] = float("nan")  # after the note: never read
        pushed = exchange.push(1, 0, "float32", gradient.numel())
        got = submit(server, 1, pushed, 1, "worker1", backward=1, noted=True).wait()
        assert torch.equal(link.reply(exchange.answer(got)).vector, push(whole, 1, gradient, 1).vector)
    finally:
        exchange.close()
        whole_exchange.close()
