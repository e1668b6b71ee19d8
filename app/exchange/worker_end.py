"""A worker's end of a PS process's shared-memory segment (app.exchange.ps_end): its push slots,
the regions the PS's replies are in, and, where the PS applies partitions early, what the
worker's backward sends it ahead of the push (app.exchange.early_push) and how its forward takes
the reply back (app.exchange.ordered_pull).

The worker maps the segment its PS offered when it joined; if it cannot (another host, another
IPC namespace, a /dev/shm it does not share, --exchange tensorpipe) it says so in one line and
pushes over TensorPipe. A GPU worker pins the regions it copies to and from
(cudaHostRegister), so the device-host copies are asynchronous DMA, not staged through
pageable memory.

What a worker's shared-memory link (app.worker.links.SharedMemoryLink) asks of it:

    bind(model, flat, ...)     once, after join: where the model reads its state and writes its
                               gradient; the hooks of the early push and the ordered pull
    with backward(version):    around each backward (the early push notes its partitions)
    seal()                     after it: what the push says of its message
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

from app.exchange.early_push import DeviceEarlyPush, EarlyPush
from app.exchange.layout import cut
from app.exchange.notes import NoteSender
from app.exchange.ordered_pull import OrderedPull
from app.exchange.segment import Offer, Segment, ShmUnavailable
from app.exchange.slot_copies import SlotCopies
from app.exchange.wire import Reply, SlotReply
from app.training.flat import FlatModel

log = logging.getLogger("app.worker")


class Sealed(NamedTuple):
    """What a push through shared memory says of its message besides the values: the slot it is
    in already (a GPU worker copies it there), and where partitions were noted, the backward the
    gradient comes from and whether its notes hold (app.ps.early). A GPU worker's copies are
    still running when it seals: the push is sent once `ready` has passed, and then `flags`
    (pinned, one a partition) say whether every value is finite."""

    placed: int | None = None
    backward: int | None = None
    noted: bool = False
    ready: Any = None  # torch.cuda.Event: the message is in its slot
    flags: torch.Tensor | None = None

    def finite(self) -> bool:
        """Once `ready` has passed: whether the flags prove every value finite."""
        return self.flags is not None and bool(self.flags.all())


class WorkerEnd:
    """Rank `rank`'s slots in a mapped segment. `place` puts a message in a push slot,
    `reply` reads an answer's state where the PS wrote it; once bound to the worker's model,
    the early push and the ordered pull."""

    def __init__(self, segment: Segment, rank: int, device: torch.device) -> None:
        self.segment, self.rank, self.device = segment, rank, device
        names = [n for n in segment.names if n.startswith(f"push{rank}.")]
        if not names:
            raise ShmUnavailable(f"{segment.path} has no push slot for rank {rank}")
        self.slots = [segment.region(n) for n in names]
        # the regions its replies come in: its own reply buffers, and a sync round's
        self.replies = [segment.region(n) for n in segment.names if n.startswith((f"reply{rank}.", "round."))]
        self.parts: list[tuple[int, int]] = []  # the partitions the PS applies ahead (app.ps.early)
        self.notes = ""  # where this worker notes them (app.exchange.notes)
        self.life = 0  # which of its rank's joins at the PS this process is: its notes carry it
        self._next = 0
        self.pinned = self._pin(rank) if device.type == "cuda" else []
        self.copies: SlotCopies | None = None  # a GPU worker's copies into its slots, once bound
        self.flat: FlatModel | None = None  # the worker's model, once bound
        self.early: EarlyPush | None = None  # notes partitions as the backward finishes them
        self.ordered: OrderedPull | None = None  # a GPU worker's partitions back, in forward order
        self.backwards = 0  # backwards run by this process: which one a push's gradient comes from
        self._claimed = False  # the last backward's notes hold

    @classmethod
    def attach(cls, offer: Offer, rank: int, device: torch.device) -> WorkerEnd:
        link = cls(Segment.attach(offer), rank, device)
        link.parts, link.notes, link.life = [(start, end) for start, end in offer.parts], offer.notes, offer.life
        return link

    def reserve(self) -> int:
        """The push slot the next message goes into, taken now (a GPU worker copies its
        partitions into it during the backward, app.exchange.early_push)."""
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
        self, model: nn.Module, flat: FlatModel, name: str, notes: bool, messages_here: bool, ordered: bool = True
    ) -> None:
        """Point the worker's model at this end. On the CPU the model reads its state where the
        PS wrote a reply (no copy) and, with `messages_here` (float32 messages), its backward
        writes the gradient straight into a push slot. With `notes` (no fp16 loss scaling, no
        --compress: the gradient is final as the backward writes it), where the PS applies
        partitions early, each partition is noted as the backward finishes it. A GPU worker
        takes each reply back partition by partition, in the order its forward needs them; without
        `ordered` (a step replayed as a CUDA graph, where no hook runs) whole, on the compute stream."""
        self.flat = flat
        cpu = self.device.type == "cpu"
        if cpu:  # the model is pointed at the PS's reply buffers: their views once
            flat.keep_views_of(self.replies)
            if messages_here:
                flat.keep_views_of(self.slots)
                flat.use_messages(self.slots)  # backward writes the gradient where the PS reads it
        parts = self.parts or cut([p.numel() for p in model.parameters()], flat.size)
        if not cpu:
            self.copies = SlotCopies(self.device, self.slots, parts)
        if notes and self.parts:
            params = list(model.parameters())
            sender = NoteSender(self.notes, self.rank, self.life)
            if self.copies is None:
                self.early = EarlyPush(params, self.parts, sender, name, self.slots)
            else:
                self.early = DeviceEarlyPush(params, self.parts, sender, name, flat, self.copies)
        if not cpu and ordered:
            self.ordered = OrderedPull(model, flat, parts)

    @contextlib.contextmanager
    def backward(self, version: int) -> Iterator[None]:
        """Around one backward, from the state of `version`: its partitions noted as it finishes
        them; afterwards, whether its notes hold."""
        if self.copies is not None:  # the copies out of the device message ran before it is written again
            self.copies.release(self.device)
        if self.early is not None:
            self.early.arm(self.backwards, self._slot(), version)
        self.backwards += 1
        yield
        self._claimed = self.early is not None and self.early.claims()

    def _slot(self) -> int:
        """The push slot the next backward's gradient goes into: the one the gradients are
        views of (CPU), or the next one taken (GPU)."""
        assert self.flat is not None  # bound
        if self.device.type != "cpu":
            return self.reserve()
        return next(k for k, slot in enumerate(self.slots) if slot.data_ptr() == self.flat.message.data_ptr())

    def seal(self, message: torch.Tensor) -> Sealed:
        """What the push of `message` (the last backward's) says of it: where it noted partitions,
        which backward it comes from and whether its notes hold. A GPU worker's message is being
        copied into its slot (the rest of it starts now): the slot, and the event to send after.
        A CPU message is put in its slot when it is sent (`slot_for`)."""
        backward, noted = (self.backwards - 1, self._claimed) if self.early is not None else (None, False)
        if isinstance(self.early, DeviceEarlyPush) and message is self.early.flat.message:
            slot, ready, flags = self.early.finish()
            return Sealed(slot, backward, noted, ready, flags)
        if self.copies is not None and message.is_cuda:  # no early push (--compress, fp16, no partitions)
            slot = self.reserve()
            if message.dtype != torch.float32:
                return Sealed(slot, backward, noted, self.copies.copy_whole(message, slot))
            for j in range(len(self.copies.pieces)):
                self.copies.copy(message, slot, j)
            return Sealed(slot, backward, noted, self.copies.landed(), self.copies.flags[slot])
        return Sealed(None, backward, noted)

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
    """The end of `peer`'s segment, or None: TensorPipe (logged in one line, once per peer)."""
    if offer is None:
        return None  # the PS has no segment, and said why in its own log
    if mode == "tensorpipe":
        log.info("%s: exchange with %s over TensorPipe (--exchange tensorpipe)", who, peer)
        return None
    try:
        link = WorkerEnd.attach(offer, rank, device)
    except ShmUnavailable as error:
        log.info("%s: %s's shared memory is not reachable from here (%s); exchange over TensorPipe", who, peer, error)
        return None
    log.info("%s: exchange with %s through shared memory (%s)", who, peer, offer.path)
    return link
