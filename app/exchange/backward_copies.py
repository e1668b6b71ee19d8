"""A GPU worker's gradient copied into its (pinned) push slot as its backward finishes each
partition (app.exchange.layout), so that at the push only the last one is left to copy.

Each .grad is a view of the device message (app.training.flat), and autograd adds each gradient
into it in place: no Python runs per parameter. The first backward of the process only looks: a
hook on every parameter (`register_post_accumulate_grad_hook`, as DDP's buckets) records the
order in which their gradients come. From then on one hook per partition, on the parameter whose
gradient came last in it, starts that partition's copy on a side stream, after the backward's
own stream reached that point, with a flag of whether it is finite computed on the device beside
it (app.exchange.slot_copies). At the push the rest (the last partition, with the buffers) is
copied the same way, and the push goes from that slot, sent once the copies landed
(app.exchange.route), nothing waited for in the training loop. The PS takes the push whole.

The copies start early only when every parameter's gradient came once in the first backward (the
order of the first backward is every backward's, as DDP's static graph takes it), and a backward
whose hooks did not each fire once has its whole message copied again at the push.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from app.exchange.layout import owners
from app.exchange.slot_copies import SlotCopies
from app.training.flat import FlatModel

log = logging.getLogger("app.worker")


def last_of_each(order: list[int], owner: list[int], count: int) -> dict[int, int]:
    """For each partition 0..count-1 that has one: the parameter (its index) whose gradient came
    last in it, from the order the parameters' gradients came in."""
    last: dict[int, int] = {}
    for i in order:
        if owner[i] < count:
            last[owner[i]] = i
    return last


class BackwardCopies:
    """Copies `flat.message` into a push slot partition by partition as the backward completes
    them. `arm(reserve)` before each backward; `finish(slot)` at the push."""

    def __init__(self, params: list[nn.Parameter], name: str, flat: FlatModel, copies: SlotCopies) -> None:
        self.params, self.name, self.flat, self.copies = params, name, flat, copies
        parts = copies.pieces
        self.owner = owners([p.numel() for p in params], parts)
        self.order: list[int] = []  # the first backward: the parameters in the order their gradients came
        self.fired = [0] * (len(parts) - 1)  # this backward: how often each early partition's hook fired
        self.counting = True  # the first backward: record the order, see that every parameter fires once
        self.on = False
        self.slot: int | None = None  # the slot the armed backward's partitions are copied into
        self.copied: set[int] = set()
        self.handles = [p.register_post_accumulate_grad_hook(self._came(i)) for i, p in enumerate(params)]

    def _came(self, i: int) -> Callable[[torch.Tensor], None]:
        def came(_param: torch.Tensor) -> None:
            self.order.append(i)

        return came

    def _complete(self, j: int) -> Callable[[torch.Tensor], None]:
        def complete(_param: torch.Tensor) -> None:
            self.fired[j] += 1
            if self.slot is not None:
                self.copies.copy(self.flat.message, self.slot, j)
                self.copied.add(j)

        return complete

    def arm(self, reserve: Callable[[], int]) -> None:
        """Before a backward: once copies start early, the push slot they go into (`reserve`
        takes it)."""
        if self.counting and self.order:
            self._place_hooks()
        self.fired = [0] * len(self.fired)
        self.slot, self.copied = (reserve() if self.on else None), set()

    def _place_hooks(self) -> None:
        """After the first backward: whether to copy early at all, and where the hooks go."""
        self.counting = False
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if sorted(self.order) != list(range(len(self.params))):
            log.info("%s: a parameter's gradient does not come once a backward: its push is copied after it", self.name)
            return
        self.on = True
        last = last_of_each(self.order, self.owner, len(self.fired))
        self.handles = [self.params[i].register_post_accumulate_grad_hook(self._complete(j)) for j, i in last.items()]

    def finish(self, slot: int) -> tuple[torch.cuda.Event, torch.Tensor]:
        """Start copying what is not in `slot` yet (the last partition and the buffers; all of it
        when the backward's hooks did not each fire once, or it was not armed for this slot): the
        event of every copy landed, and the partitions' finite flags there, valid once it has."""
        early = self.copied if self.slot == slot and all(n == 1 for n in self.fired) else set()
        for j in range(len(self.copies.pieces)):
            if j not in early:
                self.copies.copy(self.flat.message, slot, j)
        self.slot, self.copied = None, set()
        return self.copies.landed(), self.copies.flags[slot]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
