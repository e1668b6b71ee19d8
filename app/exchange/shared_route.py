"""A worker's route (app.exchange.route) to a PS process through that process's shared-memory
segment (app.exchange.ps_end), for a CPU and a GPU worker alike: a push's message is in one of
the worker's push slots and RPC carries which one (an InSlot); the reply's state is read where
the PS wrote it (a SlotReply names the region), by a CPU worker's forward as the PS writes it
(app.exchange.streamed_pull). A GPU worker copies its gradient into a slot as
its backward finishes each partition (app.exchange.backward_copies) and the reply back to the
device in the order its forward needs them (app.exchange.ordered_pull).

The worker maps the segment its PS offered when it joined (`attach`); if it cannot (another
host, another IPC namespace, a /dev/shm it does not share, --exchange transport) it says so in
one line and pushes over the job's socket (app.exchange.socket_route). A GPU worker pins the
regions it copies to and from (cudaHostRegister), so the device-host copies are asynchronous
DMA, not staged through pageable memory.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from app.contract import PS
from app.exchange import calls, progress, transport
from app.exchange.backward_copies import BackwardCopies
from app.exchange.layout import STREAMED_VALUES, cut
from app.exchange.ordered_pull import OrderedPull
from app.exchange.route import Call, Outgoing, Pending, Pusher, Pushing, flipped, refused, to_one, unreachable
from app.exchange.segment import Offer, Segment, ShmUnavailable
from app.exchange.slot_copies import SlotCopies
from app.exchange.streamed_pull import StreamedPull
from app.exchange.wire import InSlot, Push, Refusal, Reply, SlotReply, Start, Version
from app.training.flat import FlatModel

log = logging.getLogger("app.worker")


class SharedMemoryRoute(Pushing):
    """The pusher's slots in a mapped segment of PS process `name` (which serves the values
    start..end of the state): `place` puts a message in a push slot, `reply` reads an answer's
    state where the PS wrote it; once bound to a GPU worker's model, its copies out (during the
    backward) and back (in the forward's order)."""

    def __init__(
        self,
        segment: Segment,
        pusher: Pusher,
        name: str = PS,
        start: int = 0,
        end: int = 0,
        call: Call = transport.call_async,
    ) -> None:
        super().__init__(pusher)
        rank, self.device = pusher.rank, pusher.device
        self.segment, self.name, self.start, self.end, self.call = segment, name, start, end, call
        names = [n for n in segment.names if n.startswith(f"push{rank}.")]
        if not names:
            raise ShmUnavailable(f"{segment.path} has no push slot for rank {rank}")
        self.slots = [segment.region(n) for n in names]
        # the regions its replies come in: its own reply buffers, and a sync round's
        self.replies = [segment.region(n) for n in segment.names if n.startswith((f"reply{rank}.", "round."))]
        self._next = 0
        self.pinned = self._pin(rank) if self.device.type == "cuda" else []
        self.copies: SlotCopies | None = None  # a GPU worker's copies into its slots, once bound
        self.flat: FlatModel | None = None  # the worker's model, once bound
        self.outbound: BackwardCopies | None = None  # a GPU worker's gradient out as the backward finishes it
        self.ordered: OrderedPull | None = None  # a GPU worker's partitions back, in forward order
        self.streamed: StreamedPull | None = None  # a CPU worker's forward waits for each partition written

    @classmethod
    def attach(
        cls,
        offer: Offer,
        pusher: Pusher,
        name: str = PS,
        start: int = 0,
        end: int = 0,
        call: Call = transport.call_async,
    ) -> SharedMemoryRoute:
        return cls(Segment.attach(offer), pusher, name, start, end, call)

    # The segment: the slots and the regions of the replies.

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

    def reply(self, answer: SlotReply) -> Reply:
        """The answer as a Reply whose state is the region the PS wrote it in (no copy)."""
        region = self.segment.region(answer.region)
        return Reply(region, answer.version, answer.staleness, answer.lead, answer.streamed)

    def close(self) -> None:
        if self.streamed is not None:
            self.streamed.close()
        if self.pinned:
            cudart = torch.cuda.cudart()
            for name in self.pinned:
                cudart.cudaHostUnregister(self.segment.byte_range(name)[0])
            self.pinned = []

    # The model's side: where it reads its state and writes its gradient.

    def bind(
        self, model: nn.Module, flat: FlatModel, start: Start, final: bool, messages_here: bool, ordered: bool = True
    ) -> None:
        """Make `start`'s state the model's and point the model at the segment. On the CPU the
        model reads its state where the PS wrote a reply (no copy) and, with `messages_here`
        (float32 messages), its backward writes the gradient straight into a push slot. A GPU
        worker copies its gradient into a slot as the backward finishes each partition where the
        gradient is `final` then (no fp16 loss scaling, no --compress, no CUDA graph), else after
        it; it takes each reply back partition by partition, in the order its forward needs them,
        or without `ordered` (a step replayed as a CUDA graph, where no hook runs) whole, on the
        compute stream."""
        self.flat = flat
        flat.adopt(start.vector)
        if self.device.type == "cpu":  # the model is pointed at the PS's reply buffers: their views once
            flat.keep_views_of(self.replies)
            if messages_here:
                flat.keep_views_of(self.slots)
                flat.use_messages(self.slots)  # backward writes the gradient where the PS reads it
            if ordered and not self.pusher.overlap and progress.available():
                parts = cut([p.numel() for p in model.parameters()], flat.size, STREAMED_VALUES)
                self.streamed = StreamedPull(model, parts, self.pusher.timeout, self.name, self.segment.owned)
            return
        parts = cut([p.numel() for p in model.parameters()], flat.size)
        self.copies = SlotCopies(self.device, self.slots, parts)
        if final:
            self.outbound = BackwardCopies(list(model.parameters()), self.pusher.name, flat, self.copies)
        if ordered:
            self.ordered = OrderedPull(model, flat, parts)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around one step's forward and backward: a GPU worker's copies of its partitions start
        as it finishes them; after it, a CPU worker has waited for every partition of a streamed
        reply (those its forward did not read too)."""
        if self.copies is not None:  # the copies out of the device message ran before it is written again
            self.copies.release(self.device)
        if self.outbound is not None:
            self.outbound.arm(self.reserve)
        yield
        if self.streamed is not None:
            self.streamed.settle()

    def seal(self, message: torch.Tensor) -> Outgoing:
        """In its push slot: a GPU worker's copies into it run on a side stream
        (app.exchange.slot_copies), the rest of them started now, the push sent once they
        landed; a CPU message is there already (its backward wrote it) or put there when it is
        sent (`place`)."""
        flipped(self.flat, self.pusher.overlap, self.device, message)
        if self.copies is None or not message.is_cuda:
            return Outgoing(message)
        if self.outbound is not None and message is self.outbound.flat.message and self.outbound.slot is not None:
            slot = self.outbound.slot
            ready, flags = self.outbound.finish(slot)
            return Outgoing(message, slot, ready, flags)
        slot = self.reserve()  # --compress, fp16, a CUDA graph's step, the first backward
        if message.dtype != torch.float32:
            return Outgoing(message, slot, self.copies.copy_whole(message, slot))
        for j in range(len(self.copies.pieces)):
            self.copies.copy(message, slot, j)
        return Outgoing(message, slot, self.copies.landed(), self.copies.flags[slot])

    def load(self, reply: Reply) -> None:
        """Continue from `reply`'s state: a GPU worker copies it to the device as its forward
        needs it; on the CPU the model reads it where it is (no copy)."""
        assert self.flat is not None  # bound
        if self.ordered is not None:
            self.ordered.load(reply.vector)
            return
        self.flat.adopt(reply.vector)
        if self.streamed is not None:
            name = self.segment.name_of(reply.vector)
            address = self.segment.word_address(name) if name is not None else None
            if reply.streamed >= 0 and address is not None:
                self.streamed.expect(address, reply.streamed)  # the forward waits for each partition
            else:
                self.streamed.whole()

    # The push: the slot's number crosses, not the values.

    def go(self, outgoing: Outgoing, version: Version, push: Push) -> Pending:
        return to_one(self, outgoing, version, push)

    def own(self, part: torch.Tensor) -> torch.Tensor:
        """A part of a message as it travels: a view (`send` copies it into a push slot)."""
        return part

    def send(self, outgoing: Outgoing, push: Push) -> Any:
        """The RPC future of the push, its message in a push slot: the one it was sealed in, or
        the one `place` puts it in."""
        message = outgoing.message
        dtype = str(message.dtype).removeprefix("torch.")
        slot = InSlot(outgoing.slot if outgoing.slot is not None else self.place(message), dtype, message.numel())
        if self.streamed is not None:  # its forward waits for each partition: the PS may answer with the first
            push = push._replace(streamed=True)
        try:
            return self.call(self.name, calls.rpc_push, (slot, push), self.pusher.timeout)
        except RuntimeError as error:
            raise unreachable(self.pusher.address, self.name, calls.rpc_push, error) from error

    def answer(self, future: Any) -> Reply | Refusal:
        """The answer to a push: a Reply whose state is the region the PS wrote it in (no copy)."""
        try:
            answer = future.wait()
        except RuntimeError as error:
            raise unreachable(self.pusher.address, self.name, calls.rpc_push, error) from error
        return refused(self.reply(answer) if isinstance(answer, SlotReply) else answer)


def attach(offer: Offer | None, pusher: Pusher, mode: str, peer: str, start: int, end: int) -> SharedMemoryRoute | None:
    """The route through `peer`'s segment, or None: the job's socket (logged in one line, once
    per peer). `mode`: --exchange (auto, or transport: never shared memory)."""
    who = pusher.name
    if offer is None:
        return None  # the PS has no segment, and said why in its own log
    if mode == "transport":
        log.info("%s: exchange with %s over the job's transport (--exchange transport)", who, peer)
        return None
    try:
        route = SharedMemoryRoute.attach(offer, pusher, peer, start, end)
    except ShmUnavailable as error:
        log.info(
            "%s: %s's shared memory is not reachable from here (%s); exchange over the job's transport",
            who,
            peer,
            error,
        )
        return None
    log.info("%s: exchange with %s through shared memory (%s)", who, peer, offer.path)
    return route
