"""A worker's end of a PS process's shared-memory segment (app.exchange.ps_end): its push slots
and the regions the PS's replies are in; a GPU worker's copies of its gradient into a slot as
its backward finishes each partition (app.exchange.backward_copies) and of the reply back to the
device in the order its forward needs them (app.exchange.ordered_pull).

The worker maps the segment its PS offered when it joined; if it cannot (another host, another
IPC namespace, a /dev/shm it does not share, --exchange transport) it says so in one line and
pushes over the job's socket. A GPU worker pins the regions it copies to and from
(cudaHostRegister), so the device-host copies are asynchronous DMA, not staged through
pageable memory.

What a worker's shared-memory link (app.worker.links.SharedMemoryLink) asks of it:

    bind(model, flat, ...)     once, after join: where the model reads its state and writes its
                               gradient; a GPU worker's copy hooks
    with backward():           around each backward (a GPU worker's copies start during it)
    seal()                     after it: the slot the message is in, once its copies landed
    slot_for(message, sealed)  the push slot the message is in (copied there if it is not)
    reply(answer)              an answer as a Reply whose state is where the PS wrote it
    load(reply)                continue from a reply's state
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from app.exchange.backward_copies import BackwardCopies
from app.exchange.layout import cut
from app.exchange.ordered_pull import OrderedPull
from app.exchange.segment import Offer, Segment, ShmUnavailable
from app.exchange.slot_copies import SlotCopies
from app.exchange.wire import Reply, SlotReply
from app.training.flat import FlatModel

log = logging.getLogger("app.worker")


class Sealed(NamedTuple):
    """What a push through shared memory says of its message besides the values: the slot it is
    in already (a GPU worker copies it there). A GPU worker's copies are still running when it
    seals: the push is sent once `ready` has passed, and then `flags` (pinned, one a partition)
    say whether every value is finite."""

    placed: int | None = None
    ready: Any = None  # torch.cuda.Event: the message is in its slot
    flags: torch.Tensor | None = None

    def finite(self) -> bool:
        """Once `ready` has passed: whether the flags prove every value finite."""
        return self.flags is not None and bool(self.flags.all())


class WorkerEnd:
    """Rank `rank`'s slots in a mapped segment. `place` puts a message in a push slot,
    `reply` reads an answer's state where the PS wrote it; once bound to a GPU worker's model,
    its copies out (during the backward) and back (in the forward's order)."""

    def __init__(self, segment: Segment, rank: int, device: torch.device) -> None:
        self.segment, self.rank, self.device = segment, rank, device
        names = [n for n in segment.names if n.startswith(f"push{rank}.")]
        if not names:
            raise ShmUnavailable(f"{segment.path} has no push slot for rank {rank}")
        self.slots = [segment.region(n) for n in names]
        # the regions its replies come in: its own reply buffers, and a sync round's
        self.replies = [segment.region(n) for n in segment.names if n.startswith((f"reply{rank}.", "round."))]
        self._next = 0
        self.pinned = self._pin(rank) if device.type == "cuda" else []
        self.copies: SlotCopies | None = None  # a GPU worker's copies into its slots, once bound
        self.flat: FlatModel | None = None  # the worker's model, once bound
        self.outbound: BackwardCopies | None = None  # a GPU worker's gradient out as the backward finishes it
        self.ordered: OrderedPull | None = None  # a GPU worker's partitions back, in forward order

    @classmethod
    def attach(cls, offer: Offer, rank: int, device: torch.device) -> WorkerEnd:
        return cls(Segment.attach(offer), rank, device)

    def reserve(self) -> int:
        """The push slot the next message goes into, taken now (a GPU worker copies its
        partitions into it during the backward, app.exchange.backward_copies)."""
        k, self._next = self._next, (self._next + 1) % len(self.slots)
        return k

    def _pin(self, rank: int) -> list[str]:
        """Page-lock the regions this worker copies to and from (its slots and replies, and a
        sync round's); the names pinned. A region that cannot be pinned stays pageable (its
        copies are then synchronous), said once."""
        cudart = torch.cuda.cudart()
        mine = (f"push{rank}.", f"reply{rank}.", "round.")
        pinned = []
        for name in self.segment.names:
            if name.startswith(mine):
                address, size = self.segment.byte_range(name)
                if int(cudart.cudaHostRegister(address, size, 0)) == 0:
                    pinned.append(name)
        if len(pinned) < sum(n.startswith(mine) for n in self.segment.names):
            log.warning("worker%d: some shared-memory regions could not be pinned; their copies are synchronous", rank)
        return pinned

    def place(self, message: torch.Tensor) -> int:
        """Put `message` (in host memory, float32 or 16-bit) in a push slot; the slot's index. A
        message that is already in a slot (the worker's backward wrote it there) is not copied.
        (A GPU worker's message is copied into its slot as it is sealed: `seal`.)"""
        for k, slot in enumerate(self.slots):
            if message.data_ptr() == slot.data_ptr():
                self._next = (k + 1) % len(self.slots)
                return k
        k, self._next = self._next, (self._next + 1) % len(self.slots)
        view = self.slots[k].view(message.dtype)
        if message.numel() > view.numel():
            raise ValueError(f"a message of {message.numel()} {message.dtype} values does not fit a push slot")
        view[: message.numel()].copy_(message)
        return k

    def bind(
        self, model: nn.Module, flat: FlatModel, name: str, final: bool, messages_here: bool, ordered: bool = True
    ) -> None:
        """Point the worker's model at this end. On the CPU the model reads its state where the
        PS wrote a reply (no copy) and, with `messages_here` (float32 messages), its backward
        writes the gradient straight into a push slot. A GPU worker copies its gradient into a
        slot as the backward finishes each partition where the gradient is `final` then (no fp16
        loss scaling, no --compress, no CUDA graph), else after it; it takes each reply back
        partition by partition, in the order its forward needs them, or without `ordered` (a step
        replayed as a CUDA graph, where no hook runs) whole, on the compute stream."""
        self.flat = flat
        if self.device.type == "cpu":  # the model is pointed at the PS's reply buffers: their views once
            flat.keep_views_of(self.replies)
            if messages_here:
                flat.keep_views_of(self.slots)
                flat.use_messages(self.slots)  # backward writes the gradient where the PS reads it
            return
        parts = cut([p.numel() for p in model.parameters()], flat.size)
        self.copies = SlotCopies(self.device, self.slots, parts)
        if final:
            self.outbound = BackwardCopies(list(model.parameters()), name, flat, self.copies)
        if ordered:
            self.ordered = OrderedPull(model, flat, parts)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around one backward: a GPU worker's copies of its partitions start as it finishes them."""
        if self.copies is not None:  # the copies out of the device message ran before it is written again
            self.copies.release(self.device)
        if self.outbound is not None:
            self.outbound.arm(self.reserve)
        yield

    def seal(self, message: torch.Tensor) -> Sealed:
        """Where a GPU worker's `message` is being copied (the rest of it starts now): its slot,
        and the event to send after. A CPU message is put in its slot when it is sent (`slot_for`)."""
        if self.copies is None or not message.is_cuda:
            return Sealed()
        if self.outbound is not None and message is self.outbound.flat.message and self.outbound.slot is not None:
            slot = self.outbound.slot
            ready, flags = self.outbound.finish(slot)
            return Sealed(slot, ready, flags)
        slot = self.reserve()  # --compress, fp16, a CUDA graph's step, the first backward
        if message.dtype != torch.float32:
            return Sealed(slot, self.copies.copy_whole(message, slot))
        for j in range(len(self.copies.pieces)):
            self.copies.copy(message, slot, j)
        return Sealed(slot, self.copies.landed(), self.copies.flags[slot])

    def slot_for(self, message: torch.Tensor, sealed: Sealed) -> int:
        """The push slot that holds `message`: the one it was sealed in, or the one `place` puts it in."""
        return sealed.placed if sealed.placed is not None else self.place(message)

    def load(self, reply: Reply) -> None:
        """Continue from `reply`'s state: a GPU worker copies it to the device as its forward
        needs it; on the CPU the model reads it where it is (no copy)."""
        assert self.flat is not None  # bound
        if self.ordered is not None:
            self.ordered.load(reply.vector)
        else:
            self.flat.adopt(reply.vector)

    def reply(self, answer: SlotReply) -> Reply:
        """The answer as a Reply whose state is the region the PS wrote it in (no copy)."""
        return Reply(self.segment.region(answer.region), answer.version, answer.staleness, answer.lead)

    def close(self) -> None:
        if self.pinned:
            cudart = torch.cuda.cudart()
            for name in self.pinned:
                cudart.cudaHostUnregister(self.segment.byte_range(name)[0])
            self.pinned = []


def attach(offer: Offer | None, rank: int, device: torch.device, mode: str, who: str, peer: str) -> WorkerEnd | None:
    """The end of `peer`'s segment, or None: the job's socket (logged in one line, once per peer)."""
    if offer is None:
        return None  # the PS has no segment, and said why in its own log
    if mode == "transport":
        log.info("%s: exchange with %s over the job's transport (--exchange transport)", who, peer)
        return None
    try:
        link = WorkerEnd.attach(offer, rank, device)
    except ShmUnavailable as error:
        log.info(
            "%s: %s's shared memory is not reachable from here (%s); exchange over the job's transport",
            who,
            peer,
            error,
        )
        return None
    log.info("%s: exchange with %s through shared memory (%s)", who, peer, offer.path)
    return link
