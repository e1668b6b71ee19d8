"""A worker's side of a PS process's shared-memory segment (app.exchange.ps_end): its push slots and
the regions the PS's replies are in.

The worker maps the segment its PS offered when it joined; if it cannot (another host, another
IPC namespace, a /dev/shm it does not share, --exchange tensorpipe) it says so in one line and
pushes over TensorPipe. A GPU worker pins the regions it copies to and from
(cudaHostRegister), so the device-host copies are asynchronous DMA, not staged through
pageable memory.
"""

from __future__ import annotations

import logging

import torch

from app.exchange.segment import Offer, Segment, ShmUnavailable
from app.exchange.wire import Reply, SlotReply

log = logging.getLogger("app.worker")


class SharedLink:
    """Rank `rank`'s slots in a mapped segment. `place` puts a message in a push slot,
    `reply` reads an answer's state where the PS wrote it."""

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

    @classmethod
    def attach(cls, offer: Offer, rank: int, device: torch.device) -> SharedLink:
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
        """Put `message` (any device, float32 or 16-bit) in a push slot; the slot's index. A
        message that is already in a slot (the worker's backward wrote it there) is not copied.
        A device message is copied on the current stream and waited for: the slot is complete
        when this returns."""
        for k, slot in enumerate(self.slots):
            if message.device.type == "cpu" and message.data_ptr() == slot.data_ptr():
                self._next = (k + 1) % len(self.slots)
                return k
        k, self._next = self._next, (self._next + 1) % len(self.slots)
        view = self.slots[k].view(message.dtype)
        if message.numel() > view.numel():
            raise ValueError(f"a message of {message.numel()} {message.dtype} values does not fit a push slot")
        view[: message.numel()].copy_(message, non_blocking=message.is_cuda)
        if message.is_cuda:
            torch.cuda.current_stream(message.device).synchronize()
        return k

    def reply(self, answer: SlotReply) -> Reply:
        """The answer as a Reply whose state is the region the PS wrote it in (no copy)."""
        return Reply(self.segment.region(answer.region), answer.version, answer.staleness, answer.lead)

    def close(self) -> None:
        if self.pinned:
            cudart = torch.cuda.cudart()
            for name in self.pinned:
                cudart.cudaHostUnregister(self.segment.byte_range(name)[0])
            self.pinned = []


def attach(offer: Offer | None, rank: int, device: torch.device, mode: str, who: str, peer: str) -> SharedLink | None:
    """The link to `peer`'s segment, or None: TensorPipe (logged in one line, once per peer)."""
    if offer is None:
        return None  # the PS has no segment, and said why in its own log
    if mode == "tensorpipe":
        log.info("%s: exchange with %s over TensorPipe (--exchange tensorpipe)", who, peer)
        return None
    try:
        link = SharedLink.attach(offer, rank, device)
    except ShmUnavailable as error:
        log.info("%s: %s's shared memory is not reachable from here (%s); exchange over TensorPipe", who, peer, error)
        return None
    log.info("%s: exchange with %s through shared memory (%s)", who, peer, offer.path)
    return link
