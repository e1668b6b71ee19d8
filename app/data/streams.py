"""Streams: datasets read as one pass (torch's IterableDataset), split by rank and by DataLoader
process without a sampler.

A stream's pass is a list of parts (webdataset's tar shards, app/data/tarshards.py; a user's
IterableDataset is one part, `EveryNth`). A worker's share of an epoch is given as (index,
count), as the PS hands shares out (app/ps/members/epochs.py): with at least `count` parts,
every count-th part from `index`; with fewer, every part, and every count-th sample of the pass
from `index`. Each DataLoader process (torch.utils.data.get_worker_info) takes its own part of
that share the same way. Every process of the job orders the parts alike (shuffled by the seed
and the epoch), so the shares of one epoch are disjoint and together the whole pass.

What a stream gives up: a share is a slice of parts or of the pass's order, not of a
permutation of samples (a stream is shuffled only as it shuffles itself); a share of a stream of
one part reads the whole pass to keep its samples; a resumed share skips its trained batches by
reading past them (`skipped_batches`: the rest, in another order).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

T = TypeVar("T")


@dataclass(frozen=True)
class Slice:
    """The parts a reader reads, and of the samples they give in order, every `stride`-th from `offset`."""

    parts: Sequence[Any]
    stride: int = 1
    offset: int = 0

    def divided(self, count: int, index: int) -> Slice:
        """Piece `index` of `count`: by parts where there are enough of them, else by samples."""
        if len(self.parts) >= count:
            return Slice(self.parts[index::count], self.stride, self.offset)
        return Slice(self.parts, self.stride * count, self.offset + index * self.stride)

    def keep(self, samples: Iterable[T]) -> Iterator[T]:
        """Of the samples its parts give, in order, the ones this slice holds."""
        for position, sample in enumerate(samples):
            if position % self.stride == self.offset:
                yield sample


def skipped_batches(batches: int, loaders: int, loader: int) -> int:
    """Of the first `batches` batches of a share, how many DataLoader process `loader` of
    `loaders` made: the loader takes them from its processes in turn."""
    return max(0, -(-(batches - loader) // loaders))


class Stream(IterableDataset):
    """A pass over `parts`, each worker's share of it as it was last `place`d (before a
    DataLoader's processes start: a stream's loader starts them for every epoch). Subclasses
    give the samples of a part (`read`), optionally a shuffle of them (`mixed`), and a length."""

    def __init__(self, parts: Sequence[Any], seed: int, shuffle: bool) -> None:
        self.parts, self.seed, self.shuffle = list(parts), seed, shuffle
        self.share, self.epoch, self.skip, self.batch_size = (0, 1), 1, 0, 1

    def place(self, index: int, count: int, epoch: int, skip: int = 0, batch_size: int = 1) -> None:
        """The next pass reads share `index` of `count` of `epoch`, past its first `skip` samples."""
        self.share, self.epoch, self.skip, self.batch_size = (index, count), epoch, skip, max(1, batch_size)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        loaders, loader = (info.num_workers, info.id) if info is not None else (1, 0)
        order = list(self.parts)
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        mine = Slice(order).divided(self.share[1], self.share[0]).divided(loaders, loader)
        samples = self.mixed(mine.keep(self.samples(mine.parts)), loader)
        done = skipped_batches(self.skip // self.batch_size, loaders, loader) * self.batch_size
        for position, sample in enumerate(samples):
            if position >= done:
                yield sample

    def samples(self, parts: Sequence[Any]) -> Iterator[Any]:
        for part in parts:
            yield from self.read(part)

    def read(self, part: Any) -> Iterator[Any]:
        raise NotImplementedError

    def mixed(self, samples: Iterator[Any], loader: int) -> Iterator[Any]:
        """The samples in the order they train in (as they come, unless a subclass shuffles)."""
        return samples


class EveryNth(Stream):
    """A user's IterableDataset (its whole pass each time it is iterated) as a stream of one part:
    a worker's share is every count-th sample. `set_epoch(epoch)` is called on it before each
    pass where it has one (its own shuffle); its `__len__`, where it has one, is the pass's length."""

    def __init__(self, source: IterableDataset, seed: int) -> None:
        super().__init__([source], seed, shuffle=False)

    def read(self, part: Any) -> Iterator[Any]:
        set_epoch = getattr(part, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        return iter(part)

    def __len__(self) -> int:
        return len(self.parts[0])


def declared_length(data: Any) -> int | None:
    """A dataset's length where it declares one; None for a stream without one."""
    try:
        return len(data)
    except TypeError:
        return None


class StreamSampler:
    """A stream's stand-in for app.data.datasets.ShardSampler, which the trainer steers: a share
    (`shard` of `num_shards`) and `set_epoch(epoch, skip)`, handed to the stream itself."""

    fixed = False

    def __init__(self, stream: Stream, num_shards: int, shard: int, batch_size: int) -> None:
        self.stream, self.num_shards, self.shard, self.batch_size = stream, num_shards, shard, batch_size

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.stream.place(self.shard, self.num_shards, epoch, skip, self.batch_size)

    def __len__(self) -> int:
        """This share's samples where the stream declares its length (TypeError otherwise)."""
        return len(range(self.shard, len(self.stream), self.num_shards))  # type: ignore[arg-type]
