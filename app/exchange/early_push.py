"""A worker's note of each partition of its gradient as its backward finishes it, so the PS can
apply the partition before the push arrives (app.ps.early; partitions: app.exchange.layout).

A hook on every parameter (`register_post_accumulate_grad_hook`, as DDP's buckets) counts the
parameters of each partition whose gradient is in; when a partition is complete:

- on the CPU the gradient is already in the push slot (the backward writes it there): the
  worker notes it on the PS's note socket at once;
- on a GPU the partition is copied into the (pinned) push slot on a side stream, after the
  backward's own stream reached that point, and noted once the copy has landed (a thread waits
  for it); at the push the rest of the message (the last partition, with the buffers) is
  copied the same way, and the push goes from that slot with nothing copied again.

The last partition (the first layers, and the buffers) is never noted: the push carries it.
A note is a claim that the partition is final and finite: the worker checks it for NaN and inf
where it lies, in the slot, just written (on a GPU, in the thread that waits for its copy), and
a partition that is not finite is not noted, so the PS checks it with the push and refuses
that; the PS does not read a noted partition twice. The worker makes a note only when every
parameter's gradient comes once a backward (the first backward only counts, to see that they
do: a parameter the backward skips turns the notes off; a weight used twice is fine, autograd
sums its contributions before it accumulates them), and a push says its partitions were noted
only when that backward fired every hook once; otherwise the PS takes the push whole.
"""

from __future__ import annotations

import logging
import queue
import threading

import torch
from torch import nn

from app.exchange.layout import owners
from app.exchange.notes import NoteSender
from app.exchange.wire import all_finite
from app.training.flat import FlatModel

log = logging.getLogger("app.worker")


class EarlyPush:
    """Notes a worker's partitions on `sender` (its rank's, app.exchange.notes) as its backward completes them.
    `arm(backward, slot, version)` before each backward; `claims()` after it: whether the
    push may say it was noted (every parameter fired once)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        parts: list[tuple[int, int]],
        sender: NoteSender,
        name: str,
        slots: list[torch.Tensor],
    ) -> None:
        self.parts, self.sender, self.name, self.slots = parts, sender, name, slots
        self.unfinite = 0  # partitions not noted: NaN or inf in them
        self.owner = owners([p.numel() for p in params], parts)
        self.size = [self.owner.count(j) for j in range(len(parts))]
        self.fired = [0] * len(params)
        self.left = list(self.size)
        self.counting = True  # the first backward: see that every parameter fires once
        self.on = False
        self.note: tuple[int, int, int] | None = None  # (backward, slot, version) being noted
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    def _hook(self, i: int):
        def fired(_param: torch.Tensor) -> None:
            self.fired[i] += 1
            j = self.owner[i]
            self.left[j] -= 1
            if self.on and self.note is not None and self.left[j] == 0 and j < len(self.parts) - 1:
                self.complete(j)

        return fired

    def arm(self, backward: int, slot: int, version: int) -> None:
        """The next backward computes the gradient of push `backward`, written into `slot`,
        from the state of `version`."""
        self.fired = [0] * len(self.fired)
        self.left = list(self.size)
        self.note = (backward, slot, version)

    def claims(self) -> bool:
        """After the backward: whether its notes hold (every parameter fired exactly once). The
        first backward decides whether to note at all."""
        once = all(n == 1 for n in self.fired)
        if self.counting:
            self.counting, self.on = False, once
            if not once:
                log.info(
                    "%s: a parameter's gradient does not come once a backward: the PS takes pushes whole", self.name
                )
            return False
        return self.on and once

    def complete(self, j: int) -> None:
        """Partition `j` is in the slot: note it, if it is finite."""
        assert self.note is not None
        self.note_if_finite(j, self.note)

    def note_if_finite(self, j: int, note: tuple[int, int, int]) -> None:
        """Note partition `j` of the push `note` (backward, slot, version) is in its slot, if no
        NaN or inf is in it there."""
        backward, slot, version = note
        start, end = self.parts[j]
        if not all_finite(self.slots[slot][start:end]):
            self.unfinite += 1
            return
        self.sender.note_partition(backward, slot, j, version)

    def finish(self) -> int | None:
        """At the push: the slot the message is in, where this copied it there (a GPU worker);
        None on the CPU, where the backward wrote it into its slot itself."""
        return None

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class DeviceEarlyPush(EarlyPush):
    """A GPU worker's EarlyPush: each complete partition of the flat gradient buffer on the device
    (`flat.message`) is copied into the push slot on a side stream and noted once it has landed."""

    def __init__(
        self,
        params: list[nn.Parameter],
        parts: list[tuple[int, int]],
        sender: NoteSender,
        name: str,
        flat: FlatModel,
        slots: list[torch.Tensor],
    ) -> None:
        super().__init__(params, parts, sender, name, slots)
        self.flat = flat
        self.stream = torch.cuda.Stream(flat.message.device)
        self.copied: set[int] = set()
        self.landed: queue.Queue = queue.Queue()
        threading.Thread(target=self._note_landed, name="worker-notes", daemon=True).start()

    def arm(self, backward: int, slot: int, version: int) -> None:
        super().arm(backward, slot, version)
        self.copied = set()

    def complete(self, j: int) -> None:
        self._copy(j)
        done = torch.cuda.Event()
        done.record(self.stream)
        self.landed.put((done, j, self.note))

    def _copy(self, j: int) -> None:
        """Partition j of the message into the slot, on the side stream, after what the current
        stream has queued (the backward that wrote it)."""
        assert self.note is not None
        start, end = self.parts[j]
        message = self.flat.message
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(message.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            self.slots[self.note[1]][start:end].copy_(message[start:end], non_blocking=True)
        self.copied.add(j)

    def finish(self) -> int:
        """Copy what is not in the slot yet (the last partition and the buffers; every partition
        when the notes are off) and wait for all of it; the slot."""
        assert self.note is not None
        for j in range(len(self.parts)):
            if j not in self.copied:
                self._copy(j)
        self.stream.synchronize()
        return self.note[1]

    def _note_landed(self) -> None:
        while True:
            done, j, note = self.landed.get()
            done.synchronize()
            self.note_if_finite(j, note)
