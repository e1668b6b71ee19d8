"""One worker step without host waits or per-parameter Python (app.worker.trainer with
app.exchange's backward copies, ordered pull and slot copies, app.training.loop,
app.data.prefetch): counted and checked on the CPU; what needs a GPU is in test_gpu_step.py."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch
import torchvision

from app.config import parse
from app.contract import PS
from app.exchange.backward_copies import BackwardCopies
from app.exchange.layout import cut
from app.exchange.ordered_pull import BUFFERS, plan, waits
from app.exchange.ps_end import SharedExchange
from app.exchange.route import Pusher
from app.exchange.shared_route import SharedMemoryRoute
from app.exchange.wire import Reply, all_finite, finite_flag
from app.training import loop
from app.training.flat import FlatModel
from app.worker.trainer import Trainer

from app_testkit import recording_channel, started


@pytest.fixture
def shm_dir(tmp_path):
    path = Path("/dev/shm") / f"test-psc-{os.getpid()}-{tmp_path.name}"
    path.mkdir()
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def _resnet18() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def _parts(model: torch.nn.Module) -> list[tuple[int, int]]:
    sizes = [p.numel() for p in model.parameters()]
    return cut(sizes, sum(sizes) + sum(b.numel() for b in model.buffers() if b.is_floating_point()))


class Callbacks:
    """Counts the Python functions torch calls back into while it is installed: those the autograd
    engine (C++) calls during a backward (tensor hooks, post-accumulate hooks, node hooks, a
    custom Function's backward) and the hooks a module's call runs around its forward."""

    ENGINE = "_engine_run_backward"  # torch.autograd.graph: the Python frame that calls the engine
    MODULE = "_call_impl"  # torch.nn.Module: calls its hooks and its forward

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._in_engine = 0  # the engine's C++ call is running (what it calls back is counted)

    def _profile(self, frame, event, _arg) -> None:
        name = frame.f_code.co_name
        if event == "c_call" and name == self.ENGINE:
            self._in_engine += 1
        elif event in ("c_return", "c_exception") and name == self.ENGINE:
            self._in_engine -= 1
        elif event == "call" and frame.f_back is not None:
            caller = frame.f_back.f_code.co_name
            if (caller == self.ENGINE and self._in_engine) or (caller == self.MODULE and name != "forward"):
                self.calls.append(f"{frame.f_code.co_filename}:{name}")

    def __enter__(self) -> Callbacks:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


def _count_steps(shm_dir: Path, monkeypatch, accumulate: bool, steps: int = 3):
    """A ResNet-18 worker on the CPU whose pushes go through a real push slot (its PS end in this
    process, the replies the state it started from): (the callbacks of `steps` steps after two
    warm-up ones, the partitions, the worker's route through the segment, the channel, the trainer).
    `accumulate`: its FlatModel adds the gradients into the zeroed message, as on a GPU."""
    monkeypatch.setattr("app.worker.trainer.FlatModel", functools.partial(FlatModel, accumulate=accumulate))
    model = _resnet18()
    parts = _parts(model)
    flat_size = parts[-1][1]
    exchange = SharedExchange.open(str(shm_dir), flat_size, 1, overlap=False, sync=False)
    state: list[torch.Tensor] = []  # the state the PS answers with: the one the worker started from
    channel = recording_channel(lambda message, version: Reply(state[0].clone(), version + 1, 0, 0))
    channel.real = end = SharedMemoryRoute.attach(exchange.offer(), Pusher(1, "worker1"), PS, 0, flat_size)
    trainer = Trainer(parse(["worker"], {}), model, None, None, torch.device("cpu"), channel, None)
    started(trainer)
    state.append(trainer.flat.vector.clone())
    torch.manual_seed(1)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    for _ in range(2):  # the first backward records the order the gradients come in
        trainer.compute_gradients(x, y)
        trainer.push_and_pull()
    with Callbacks() as counted:
        for _ in range(steps):
            trainer.compute_gradients(x, y)
            trainer.push_and_pull()
    exchange.close()
    return counted.calls, parts, end, channel, trainer


class Recorded:
    """app.exchange.slot_copies.SlotCopies as BackwardCopies asks it (the copies need a GPU): the
    pieces, and the copies asked for, recorded."""

    def __init__(self, pieces: list[tuple[int, int]]) -> None:
        self.pieces, self.asked = pieces, 0
        self.flags = torch.ones(1, len(pieces), dtype=torch.bool)

    def copy(self, message: torch.Tensor, slot: int, piece: int) -> None:
        self.asked += 1

    def landed(self) -> None:
        return None


def test_a_resnet18_backward_calls_back_into_python_once_a_partition_but_the_last(shm_dir, monkeypatch):
    """Gradients added in place into the zeroed message (a GPU worker's way, here on the CPU): no
    hook per parameter. A GPU worker's copies out (app.exchange.backward_copies) add one
    post-accumulate hook per partition but the last, from the second backward on: ResNet-18 has
    62 parameters in 7 partitions, so 6 callbacks a step (a GPU worker's forward adds one wait per
    partition and one for the buffers, 8: the test below), where a hook per parameter made 124 (a
    tensor hook and a post-accumulate hook each). The gradient pushed is the write-once one's,
    value for value."""
    calls, parts, end, channel, trainer = _count_steps(shm_dir, monkeypatch, accumulate=True, steps=3)
    assert len(parts) == 7 and calls == []  # a CPU worker: nothing runs in Python during a step
    assert channel.messages[-1].data_ptr() == end.slots[0].data_ptr()  # the backward wrote the gradient there
    pushed = channel.messages[-1].clone()
    monkeypatch.undo()
    calls, _, _, channel, _ = _count_steps(shm_dir, monkeypatch, accumulate=False, steps=1)
    assert torch.equal(channel.messages[-1], pushed)

    model = _resnet18()
    flat = FlatModel(model, accumulate=True)
    recorded = Recorded(parts)
    copies = BackwardCopies(list(model.parameters()), "worker1", flat, recorded)  # type: ignore[arg-type]
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    steps = 3
    for _ in range(steps + 1):  # the first backward records the order the gradients come in
        with Callbacks() as counted:
            copies.arm(lambda: 0)
            with flat.writing_grads():
                torch.nn.functional.cross_entropy(model(x), y).backward()
        copies.finish(0)
    assert len(counted.calls) == len(parts) - 1, counted.calls
    assert recorded.asked == len(parts) * (steps + 1)  # every partition once a step: during it or at the push


def test_a_cpu_workers_step_writes_each_gradient_once_through_a_hook_a_parameter(shm_dir, monkeypatch):
    """On the CPU a gradient is copied into its place in the push slot by a hook on it (one write
    of its bytes, where a fill and an in-place add cost ~2 ms more a step there): 62 tensor hooks
    a step, where it was 124."""
    calls, parts, end, channel, trainer = _count_steps(shm_dir, monkeypatch, accumulate=False, steps=2)
    params = len(list(trainer.model.parameters()))
    assert params == 62 and len(calls) == 2 * params, len(calls)


def test_a_gpu_workers_forward_waits_once_per_partition_where_it_first_needs_it():
    """app.exchange.ordered_pull.plan on ResNet-18's first forward (recorded on the CPU): one hook
    per partition and one for the buffers (8), where a hook per module made 41, each on the first
    module to run that needs it."""
    model = _resnet18()
    parts = _parts(model)
    needs = waits(model, parts)
    ran: list = []
    handles = [m.register_forward_pre_hook(lambda m, _i: ran.append(m)) for m in needs]
    model(torch.randn(2, 3, 32, 32))
    for h in handles:
        h.remove()
    planned = plan(needs, ran)
    assert len(needs) == 41 and len(planned) == len(parts) + 1  # conv1 waits for partition 0, bn1 for the buffers
    waited = [j for _, copies in planned for j in copies]
    assert sorted(waited) == [BUFFERS, *range(len(parts))]  # each copy waited for once
    first_run = {}
    for module in ran:
        for j in needs[module][0] + ([BUFFERS] if needs[module][1] else []):
            first_run.setdefault(j, module)
    assert all(first_run[j] is module for module, copies in planned for j in copies)


@pytest.mark.parametrize("overlap,lag", [(True, 2), (False, 1)])
def test_the_overlap_contract_push_t_computed_on_reply_t_minus_2_and_sent_after_it_is_taken(overlap, lag):
    """--overlap: the push of batch t is sent once the reply to push t-1 is taken, and batch t+1
    computes on that reply's state: every push after the first two is computed on the state of
    the reply two pushes back (one push on the wire). Without it, each push is computed on the
    reply just before it."""
    events: list[tuple[str, int]] = []

    def answer(message, version):
        events.append(("sent", version))
        return Reply(torch.zeros(message.numel()), len([e for e in events if e[0] == "sent"]), 0, 0)

    channel = recording_channel(answer, overlap=overlap)
    loaded = channel.load

    def load(reply):
        events.append(("loaded", reply.version))
        loaded(reply)

    channel.load = load
    config = parse(["worker", "--overlap", str(overlap).lower()], {})
    trainer = Trainer(config, torch.nn.Linear(3, 1), None, None, torch.device("cpu"), channel, None)
    started(trainer)
    for _ in range(6):
        trainer.compute_gradients(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))
        trainer.push_and_pull()
    trainer.last_reply()
    sent = [v for kind, v in events if kind == "sent"]
    assert sent == [0] + [max(0, k - lag + 1) for k in range(1, 6)], sent
    sends = [i for i, e in enumerate(events) if e[0] == "sent"]
    # each push goes only after the reply to the one before it is taken: one push on the wire
    assert all(events.index(("loaded", k)) < sends[k] for k in range(1, 6)), events


def test_device_flags_are_true_only_for_finite_values_and_a_false_one_is_checked_again():
    values = torch.randn(1000)
    flag = finite_flag(values)
    assert flag.dtype == torch.bool and flag.numel() == 1 and flag.device == values.device and bool(flag)
    for bad in (float("nan"), float("inf"), float("-inf")):
        spoiled = values.clone()
        spoiled[17] = bad
        assert not bool(finite_flag(spoiled)) and not all_finite(spoiled)
    huge = torch.full((4,), 3e38)  # finite, but the sum overflows: the flag says no, the floats say yes
    assert not bool(finite_flag(huge)) and all_finite(huge)
    both = torch.tensor([float("inf"), -float("inf")])
    assert not bool(finite_flag(both))  # inf - inf: NaN, not finite


def test_batches_on_the_device_are_the_loaders_in_order_with_the_same_values():
    from torch.utils.data import DataLoader

    from app.data.builtin import InMemoryData

    g = torch.Generator().manual_seed(0)
    data = InMemoryData(torch.randint(0, 255, (40, 1, 6, 6), generator=g), torch.arange(40) % 3, [0.5], [0.25], 1 / 255)
    loader = DataLoader(data, batch_size=None, sampler=torch.utils.data.BatchSampler(range(40), 8, False))
    plain = [loop.on_device(x, y, loader, torch.device("cpu"), torch.contiguous_format) for x, y in loader]
    prepared = list(loop.device_batches(loader, torch.device("cpu"), torch.contiguous_format)(iter(loader)))
    assert len(prepared) == len(plain) == 5
    for (a, b), (c, d) in zip(plain, prepared):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_a_loss_on_the_cpu_is_read_at_once_and_a_held_report_is_written_with_the_next_batch(tmp_path):
    from app.training.metrics import MetricsWriter, read

    with MetricsWriter(str(tmp_path), "worker1", "worker", 1) as metrics:
        reporter = loop.Reporter("worker1", 1, metrics)
        loader = torch.utils.data.DataLoader(list(range(40)), batch_size=4)  # 10 batches
        reporter.batch_done(loader, 1, 1, 1, 4, loop.Loss(torch.tensor(2.5), ready=True))
        assert [r["loss"] for r in read(tmp_path / "worker1.jsonl") if r["event"] == "train"] == [2.5]
        reporter.batch_done(loader, 2, 1, 2, 4, loop.Loss(torch.tensor(1.5), ready=False))  # a GPU's, on its way
        assert len([r for r in read(tmp_path / "worker1.jsonl") if r["event"] == "train"]) == 1
        reporter.batch_done(loader, 3, 1, 3, 4, loop.Loss(torch.tensor(0.5), ready=False))
        reporter.flush()
    got = [(r["batch"], r["loss"]) for r in read(tmp_path / "worker1.jsonl") if r["event"] == "train"]
    assert got == [(1, 2.5), (2, 1.5), (3, 0.5)]
