"""A worker's note of each partition of its gradient as its backward finishes them, so the PS can
apply the partition before the push arrives (app.ps.early; partitions: app.exchange.layout).

Each .grad is a view of the message (app.training.flat), and autograd adds each gradient into
it in place: no Python runs per parameter. The first backward of the process only looks: a hook
on every parameter (`register_post_accumulate_grad_hook`, as DDP's buckets) records the order
in which their gradients come. From then on one hook per partition, on the parameter whose
gradient came last in it, says the partition is complete (the order of the first backward is
every backward's, as DDP's static graph takes it):

- on the CPU the gradient is already in the push slot (the backward writes it there): the
  worker checks it for NaN and inf where it lies, then notes it on the PS's note socket;
- on a GPU the partition is copied into the (pinned) push slot on a side stream, after the
  backward's own stream reached that point, with a flag of whether it is finite computed on the
  device beside it (app.exchange.slot_copies); a thread waits for each copy to land and notes
  the partition if its flag says finite. At the push the rest of the message (the last
  partition, with the buffers) is copied the same way, and the push goes from that slot, sent
  once the copies landed (app.worker.channels), nothing waited for in the training loop.

The last partition (the first layers, and the buffers) is never noted: the push carries it.
A note is a claim that the partition is final and finite, so the PS does not check it again; a
partition that is not finite is not noted, and the PS checks it with the push and refuses that.
The worker makes notes only when every parameter's gradient came once in the first backward (a
parameter the backward skips turns the notes off; a weight used twice is fine, autograd sums its
contributions before it accumulates them), and a push says its partitions were noted only when
that backward fired each partition's hook once; otherwise the PS takes the push whole.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch
from torch import nn

from app.exchange.layout import owners
from app.exchange.notes import NoteSender
from app.exchange.slot_copies import SlotCopies
from app.exchange.wire import all_finite
from app.training.flat import FlatModel

log = logging.getLogger("app.worker")
Note = tuple[int, int, int]  # (backward, slot, version) of the push being noted


def last_of_each(order: list[int], owner: list[int], count: int) -> dict[int, int]:
    """For each partition 0..count-1 that has one: the parameter (its index) whose gradient came
    last in it, from the order the parameters' gradients came in."""
    last: dict[int, int] = {}
    for i in order:
        if owner[i] < count:
            last[owner[i]] = i
    return last


class EarlyPush:
    """Notes a worker's partitions on `sender` (its rank's, app.exchange.notes) as its backward completes them.
    `arm(backward, slot, version)` before each backward; `claims()` after it: whether the
    push may say it was noted (each partition's hook fired once)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        parts: list[tuple[int, int]],
        sender: NoteSender,
        name: str,
        slots: list[torch.Tensor],
    ) -> None:
        self.params, self.parts, self.sender, self.name, self.slots = params, parts, sender, name, slots
        self.unfinite = 0  # partitions not noted: NaN or inf in them
        self.owner = owners([p.numel() for p in params], parts)
        self.order: list[int] = []  # the first backward: the parameters in the order their gradients came
        self.fired = [0] * (len(parts) - 1)  # this backward: how often each noted partition's hook fired
        self.counting = True  # the first backward: record the order, see that every parameter fires once
        self.on = False
        self.note: Note | None = None
        self.handles = [p.register_post_accumulate_grad_hook(self._came(i)) for i, p in enumerate(params)]

    def _came(self, i: int) -> Callable[[torch.Tensor], None]:
        def came(_param: torch.Tensor) -> None:
            self.order.append(i)

        return came

    def _complete(self, j: int) -> Callable[[torch.Tensor], None]:
        def complete(_param: torch.Tensor) -> None:
            self.fired[j] += 1
            if self.note is not None:
                self.complete(j)

        return complete

    def arm(self, backward: int, slot: int, version: int) -> None:
        """The next backward computes the gradient of push `backward`, written into `slot`,
        from the state of `version`."""
        self.fired = [0] * len(self.fired)
        self.note = (backward, slot, version) if self.on else None

    def claims(self) -> bool:
        """After the backward: whether its notes hold (each partition's hook fired exactly once).
        The first backward decides whether to note at all, and where the hooks go."""
        if not self.counting:
            return self.on and all(n == 1 for n in self.fired)
        self.counting = False
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if sorted(self.order) != list(range(len(self.params))):
            log.info("%s: a parameter's gradient does not come once a backward: the PS takes pushes whole", self.name)
            return False
        self.on = True
        last = last_of_each(self.order, self.owner, len(self.fired))
        self.handles = [self.params[i].register_post_accumulate_grad_hook(self._complete(j)) for j, i in last.items()]
        return False

    def complete(self, j: int) -> None:
        """Partition `j` is in the slot (the backward wrote it there): note it, if it is finite."""
        assert self.note is not None
        backward, slot, version = self.note
        start, end = self.parts[j]
        if not all_finite(self.slots[slot][start:end]):
            self.unfinite += 1
            return
        self.sender.note_partition(backward, slot, j, version)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class DeviceEarlyPush(EarlyPush):
    """A GPU worker's EarlyPush: each complete partition of the flat gradient buffer on the device
    (`flat.message`) is copied into the push slot on a side stream, with its finite flag, and
    noted once it has landed and if its flag says finite."""

    def __init__(
        self,
        params: list[nn.Parameter],
        parts: list[tuple[int, int]],
        sender: NoteSender,
        name: str,
        flat: FlatModel,
        copies: SlotCopies,
    ) -> None:
        super().__init__(params, parts, sender, name, copies.slots)
        self.flat, self.copies = flat, copies
        self.slot = 0  # the slot the armed backward's partitions are copied into
        self.copied: set[int] = set()
        self.landed: queue.Queue[tuple[torch.cuda.Event, int, Note]] = queue.Queue()
        threading.Thread(target=self._note_landed, name="worker-notes", daemon=True).start()

    def arm(self, backward: int, slot: int, version: int) -> None:
        super().arm(backward, slot, version)
        self.slot, self.copied = slot, set()

    def complete(self, j: int) -> None:
        assert self.note is not None
        landed = self.copies.copy(self.flat.message, self.slot, j)
        self.copied.add(j)
        self.landed.put((landed, j, self.note))

    def finish(self) -> tuple[int, torch.cuda.Event, torch.Tensor]:
        """Start copying what is not in the slot yet (the last partition and the buffers; every
        partition when the notes are off): (the slot, the event of every copy landed, the
        partitions' finite flags there, valid once it has)."""
        for j in range(len(self.parts)):
            if j not in self.copied:
                self.copies.copy(self.flat.message, self.slot, j)
        return self.slot, self.copies.landed(), self.copies.flags[self.slot]

    def _note_landed(self) -> None:
        while True:
            landed, j, (backward, slot, version) = self.landed.get()
            landed.synchronize()  # wait here, in this thread: the copy and its flag are in host memory
            if bool(self.copies.flags[slot, j]):
                self.sender.note_partition(backward, slot, j, version)
            else:
                self.unfinite += 1
