"""Each epoch trained once in all, by whoever is there: the job's progress per epoch, in shares.

A job that may be scaled while it runs (--max_workers above the workers it starts with) cannot
give each rank a fixed shard of the data: the ranks training change. Its workers ask the PS,
one share at a time, what to train next (`EpochShares.next`). An epoch is split when the first
rank asks for it, into as many shares as ranks train then (each share every count-th sample
of the epoch's permutation, app.data.datasets.ShardSampler); each share is handed out once and
trained once, from where the last rank that held it stopped:

- a rank's own share, where its process restarted: from the batches its pushes recorded;
- a share no rank holds (a rank that left, or one missing past --join_timeout, held it), or
  one no rank took yet: the earliest first, whoever asks (in an epoch, the rank's own place
  among the ranks it was split for, where that share is free); a faster rank takes more;
- otherwise the next epoch, split among the ranks training now; none left: the rank is done.

So a rank that is alone takes only what is left of each epoch, never a whole epoch again, and
the updates applied are epochs x batches, whoever finishes first. Plain Python under the
server's lock (app.ps.members.members); its state goes into the PS's checkpoints.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from app.exchange.wire import Share


@dataclass
class Part:
    """One share of an epoch: who trains it (None: nobody now), how many of its batches are
    done, and whether it is done."""

    holder: int | None = None
    done: int = 0
    complete: bool = False


class EpochShares:
    """Epochs 1..num_epochs, each split into shares as it is reached, and who trains which."""

    def __init__(self, num_epochs: int, first_epoch: int = 1) -> None:
        self.num_epochs = num_epochs
        self.first_epoch = first_epoch  # epochs before it are done (a checkpoint from before these shares)
        self.splits: dict[int, list[Part]] = {}  # epoch -> its shares, split when first asked for
        self.order: dict[int, list[int]] = {}  # epoch -> the ranks it was split for (share i: the i-th's)
        self.current: dict[int, tuple[int, int]] = {}  # rank -> (epoch, index) of the share it trains

    def next(self, rank: int, finished: Share | None, ranks: Sequence[int], gone: Collection[int]) -> Share | None:
        """What `rank` trains next, having trained `finished` (None: a process that starts).
        `ranks`: those training now (the count a new epoch is split into, and rank's place
        among them); `gone`: ranks that train no more (left, or missing): their shares are
        free. None: nothing is left; the rank is done."""
        held = self.current.get(rank)
        if finished is not None and held == (finished.epoch, finished.shard):
            self.splits[held[0]][held[1]].complete = True
            del self.current[rank]
            held = None
        if held is None:
            held = self._free(rank, gone) or self._split(rank, ranks)
        if held is None:
            return None
        epoch, index = held
        for other, place in list(self.current.items()):  # taken over from a rank that is gone
            if place == held and other != rank:
                del self.current[other]
        part = self.splits[epoch][index]
        part.holder, self.current[rank] = rank, held
        return Share(epoch, index, len(self.splits[epoch]), part.done)

    def record(self, rank: int, epoch: int, batch: int) -> None:
        """A push of rank's applied: `batch` batches of its share of `epoch` are done."""
        held = self.current.get(rank)
        if held is not None and held[0] == epoch:
            self.splits[epoch][held[1]].done = batch

    def release(self, rank: int) -> None:
        """`rank` trains no more (it left): its share goes to whoever asks next."""
        held = self.current.pop(rank, None)
        if held is not None:
            self.splits[held[0]][held[1]].holder = None

    def _free(self, rank: int, gone: Collection[int]) -> tuple[int, int] | None:
        """A share not done that no rank training holds, of the earliest epoch that has one:
        rank's own place in that epoch's split, where it is free."""
        for epoch in sorted(self.splits):
            free = [
                i for i, part in enumerate(self.splits[epoch]) if not part.complete and part.holder in (None, *gone)
            ]
            if free:
                order = self.order[epoch]
                place = order.index(rank) if rank in order else -1
                return epoch, place if place in free else free[0]
        return None

    def _split(self, rank: int, ranks: Sequence[int]) -> tuple[int, int] | None:
        """The next epoch not split yet, split among `ranks`; rank's place in it."""
        epoch = max([self.first_epoch - 1, *self.splits]) + 1
        if epoch > self.num_epochs:
            return None
        order = self.order[epoch] = sorted({*ranks, rank})
        self.splits[epoch] = [Part() for _ in order]
        return epoch, order.index(rank)

    def used(self) -> bool:
        return bool(self.splits)

    def state(self) -> dict[str, Any]:
        """For a checkpoint: each split epoch's shares, and who trains which."""
        return {
            "first_epoch": self.first_epoch,
            "splits": {e: [(p.holder, p.done, p.complete) for p in parts] for e, parts in self.splits.items()},
            "order": dict(self.order),
            "current": dict(self.current),
        }

    def restore(self, saved: dict[str, Any] | None, first_epoch: int = 1) -> None:
        """The shares a checkpoint holds; without any (a checkpoint from before they were
        split), every epoch before `first_epoch` counts as done."""
        if saved is None:
            self.first_epoch, self.splits, self.order, self.current = first_epoch, {}, {}, {}
            return
        self.first_epoch = int(saved["first_epoch"])
        self.splits = {
            int(e): [Part(holder, done, complete) for holder, done, complete in parts]
            for e, parts in saved["splits"].items()
        }
        self.order = {int(e): [int(r) for r in ranks] for e, ranks in saved["order"].items()}
        self.current = {int(r): (int(e), int(i)) for r, (e, i) in saved["current"].items()}
