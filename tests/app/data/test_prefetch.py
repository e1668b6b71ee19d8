"""Batches from loader processes received one ahead, in a thread (app.data.prefetch):
the same batches in the same order, errors where the loop takes its next batch, no thread left."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch.utils.data import Dataset

from app.data import datasets
from app.data.prefetch import ReceivedAhead, wants_thread
from app.training import loop


class Numbers(Dataset):
    """Sample i is (i as a 2-value tensor, i % 3); index `bad` raises OSError, as a read of a
    file gone does."""

    def __init__(self, length: int, bad: int = -1) -> None:
        self.length, self.bad = length, bad

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == self.bad:
            raise OSError(f"sample {i} cannot be read")
        return torch.full((2,), float(i)), i % 3


def _receiving() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "batches-ahead"]


def _epoch(loader, sampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return [x[:, 0].int().tolist() for x, _ in datasets.batches(loader, "/data")]


def test_loader_processes_give_the_same_batches_in_the_same_order_and_no_thread_stays():
    sampler = datasets.ShardSampler(40, 2, 1, seed=4)
    in_process = datasets.train_loader(Numbers(40), sampler, 4, 0, pin_memory=False)
    in_processes = datasets.train_loader(Numbers(40), sampler, 4, 2, pin_memory=False)
    assert not wants_thread(in_process) and wants_thread(in_processes)
    for epoch in (1, 2):  # the loader's processes are kept from one epoch to the next
        expected = _epoch(in_process, sampler, epoch)
        assert _epoch(in_processes, sampler, epoch) == expected and len(expected) == 5
        assert _receiving() == []


def test_a_loop_that_stops_early_stops_the_thread_and_the_next_epoch_is_whole():
    sampler = datasets.ShardSampler(40, 1, 0, seed=1)
    loader = datasets.train_loader(Numbers(40), sampler, 4, 1, pin_memory=False)
    batches = loop.resume_batches(loader, sampler, "/data", 1, 0, 3, 4)
    taken = [next(batches) for _ in range(3)]
    assert [batch for _, batch, _, _ in taken] == [1, 2, 3] and _receiving()
    batches.close()  # a worker that reached --max_steps
    assert _receiving() == []
    sampler.set_epoch(2)
    assert sum(len(y) for _, y in datasets.batches(loader, "/data")) == 40


def test_a_read_that_fails_in_a_loader_process_is_one_clear_error_after_the_batches_before_it():
    sampler = datasets.ShardSampler(12, 1, 0, shuffle=False)
    loader = datasets.train_loader(Numbers(12, bad=9), sampler, 4, 1, pin_memory=False)
    batches = datasets.batches(loader, "/data/images")
    assert [x[:, 0].int().tolist() for x, _ in (next(batches), next(batches))] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(datasets.DataUnavailable, match="reading the data under /data/images failed"):
        next(batches)
    assert _receiving() == []
    # Its loader process goes here, not in whichever test's collection would find it: shutting
    # it down waits out the loader's 5 s join, which stalled an unrelated test's clock.
    del batches, loader
    gc.collect()


def test_received_ahead_gives_every_item_then_what_the_iterator_raised():
    def items():
        yield from range(5)
        raise ValueError("the fifth")

    ahead = ReceivedAhead(items())
    assert [next(ahead) for _ in range(5)] == list(range(5))
    with pytest.raises(ValueError, match="the fifth"):
        next(ahead)
    assert not ahead.receiving
    assert list(ReceivedAhead(iter("abc"))) == ["a", "b", "c"]
