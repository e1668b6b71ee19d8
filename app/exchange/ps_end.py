"""The PS side of the same-host exchange: a shared-memory segment (app.exchange.segment) holding each
rank's push slots and reply buffers, so that a worker on this host hands its push over as
memory and reads the PS's answer in place; RPC carries only which slot, the version and
where the worker is (app.exchange.calls.rpc_push, its message an InSlot).

Per rank r (1..the most workers the job may have): `slots` push slots `push<r>.<k>`, where the
worker writes `[grads | buffers]` (its backward writes the gradients straight into one when it
trains on the CPU), and as many reply buffers `reply<r>.<k>`, where the PS writes the new state
(app.ps.server's reply buffers: async builds the new state in them, so the reply is never a
copy). `slots` is 1, or 2 with --overlap (a push is in flight while the next gradient is being
written, and the worker computes on one reply while the next lands in the other). Under sync
the round's two reply buffers `round.0`, `round.1` are shared by every rank.

A worker on another host, or one that cannot map the segment, pushes over the job's socket instead:
the reply buffers serve both ways.

The PS asks its end of the exchange (`PSEnd`) the same questions whether it has a segment or
not: `for_config` decides once, where the segment is made, and a PS process without one (its
workers all push over the job's sockets) holds `NO_SEGMENT`, which offers nothing, holds no tensor, has
no reply buffers, and refuses a push from a slot.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from app.config import Config
from app.contract import strategy_of
from app.exchange import progress
from app.exchange.layout import STREAMED_VALUES, cut
from app.exchange.progress import Progress
from app.exchange.segment import Offer, Segment, ShmUnavailable
from app.exchange.wire import Reply, SlotReply
from app.runtime import lifecycle, words
from app.training.flat import state_size

log = logging.getLogger("app.ps")
WIRE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def region_names(max_rank: int, overlap: bool, sync: bool) -> list[str]:
    """Every region of a segment, in file order (app.contract.exchange_regions counts them)."""
    pushes = replies = 2 if overlap else 1
    names = [f"round.{k}" for k in range(2)] if sync else []
    for rank in range(1, max_rank + 1):
        names += [f"push{rank}.{k}" for k in range(pushes)] + [f"reply{rank}.{k}" for k in range(replies)]
    return names


class PSEnd(Protocol):
    """What the PS asks of its end of the exchange: a segment's (`SharedExchange`), or none's
    (`NO_SEGMENT`)."""

    def offer(self) -> Offer | None: ...
    def reply_buffers(self, rank: int) -> list[torch.Tensor] | None: ...
    def push(self, rank: int, slot: int, dtype: str, numel: int) -> torch.Tensor: ...
    def holds(self, tensor: torch.Tensor) -> bool: ...
    def progress(self, tensor: torch.Tensor) -> Progress | None: ...
    def streamed_parts(self, sizes: list[int]) -> list[tuple[int, int]]: ...
    def answer(self, reply: object) -> object: ...
    def close(self) -> None: ...


class NoSegment:
    """The end of a PS process without a segment (--exchange transport, or no shared memory
    here): every push and reply crosses over the job's sockets."""

    def offer(self) -> Offer | None:
        """Nothing to map: the worker pushes over the job's socket."""
        return None

    def reply_buffers(self, rank: int) -> list[torch.Tensor] | None:
        """None: the PS keeps every rank's reply buffers in its own memory."""
        return None

    def push(self, rank: int, slot: int, dtype: str, numel: int) -> torch.Tensor:
        """Refused: no worker was offered a slot."""
        raise RuntimeError("this parameter server has no shared-memory segment")

    def holds(self, tensor: torch.Tensor) -> bool:
        return False

    def progress(self, tensor: torch.Tensor) -> Progress | None:
        return None

    def streamed_parts(self, sizes: list[int]) -> list[tuple[int, int]]:
        """None: no reply buffer here has a word to stream it by."""
        return []

    def answer(self, reply: object) -> object:
        return reply

    def close(self) -> None:
        pass


NO_SEGMENT = NoSegment()


class SharedExchange:
    """A PS process's segment, read as ranks' slots and reply buffers."""

    def __init__(self, segment: Segment) -> None:
        self.segment, self.floats = segment, segment.floats
        self._progress: dict[str, Progress] = {}

    @classmethod
    def open(cls, directory: str, floats: int, max_rank: int, overlap: bool, sync: bool) -> SharedExchange:
        """A new segment for a state of `floats` values; ShmUnavailable when it cannot be had."""
        return cls(Segment.create(directory, floats, region_names(max_rank, overlap, sync)))

    def offer(self) -> Offer:
        """What a worker maps."""
        return self.segment.offer()

    def reply_buffers(self, rank: int) -> list[torch.Tensor] | None:
        """Rank's reply buffers (rank 0: a sync round's), in the segment; None for a rank it
        has none for (the PS keeps that rank's buffers in its own memory)."""
        prefix = "round." if rank == 0 else f"reply{rank}."
        buffers = [self.segment.region(n) for n in self.segment.names if n.startswith(prefix)]
        return buffers or None

    def push(self, rank: int, slot: int, dtype: str, numel: int) -> torch.Tensor:
        """The message rank wrote into its push slot `slot`: `numel` values of `dtype`, a view."""
        name = f"push{rank}.{slot}"
        if name not in self.segment.names or dtype not in WIRE:
            raise ValueError(f"worker{rank} pushed from slot {slot} as {dtype}: this segment has no such slot")
        region = self.segment.region(name).view(WIRE[dtype])
        if numel > region.numel():
            raise ValueError(f"worker{rank} pushed {numel} {dtype} values; its slot holds {region.numel()}")
        return region[:numel]

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory is in the segment."""
        return 0 <= tensor.data_ptr() - self.segment.base < self.segment.size

    def progress(self, tensor: torch.Tensor) -> Progress | None:
        """The word that says how far the region `tensor` is has been written, where it is a
        whole reply region with a word and replies may be streamed here (app.exchange.progress)."""
        name = self.segment.name_of(tensor)
        if name is None or tensor.numel() != self.floats or not name.startswith("reply") or not progress.available():
            return None
        if name not in self._progress:
            address = self.segment.word_address(name)
            if address is None:
                return None
            self._progress[name] = Progress(address)
        return self._progress[name]

    def streamed_parts(self, sizes: list[int]) -> list[tuple[int, int]]:
        """The partitions a streamed reply is written in, for parameters of `sizes` values: the
        ones its worker's forward waits for (app.exchange.shared_route cuts them alike)."""
        return cut(sizes, self.floats, STREAMED_VALUES)

    def answer(self, reply: object) -> object:
        """What goes back over RPC: a Reply whose state is a region of the segment becomes a
        SlotReply naming it (nothing else crosses); anything else goes as it is."""
        if isinstance(reply, Reply):
            name = self.segment.name_of(reply.vector)
            if name is not None and reply.vector.numel() == self.floats:
                assert isinstance(reply.version, int)  # one PS process's version
                return SlotReply(name, reply.version, reply.staleness, reply.lead, reply.streamed)
        return reply

    def close(self) -> None:
        self.segment.close()


def for_config(config: Config, model: nn.Module, part: tuple[int, int] | None, who: str) -> PSEnd:
    """The segment PS process `who` offers its workers for `model`'s state (or the slice `part`
    of it), or NO_SEGMENT (--exchange transport, or no shared memory here: said in one line, and
    every worker pushes over the job's sockets). It is removed when the process ends (lifecycle.on_exit)."""
    floats = part[1] - part[0] if part is not None else state_size(model)
    shared = open_exchange(
        config.exchange,
        config.shm_dir,
        floats,
        config.max_trainers,
        config.overlap,
        strategy_of(config.strategy).rounds,
        who,
    )
    lifecycle.on_exit(shared.close)
    return shared


def open_exchange(
    mode: str,
    directory: str,
    floats: int,
    max_rank: int,
    overlap: bool,
    sync: bool,
    who: str,
) -> PSEnd:
    """As `for_config`, from its parts."""
    if mode == "transport":
        log.info("%s: exchange over the job's transport (--exchange transport)", who)
        return NO_SEGMENT
    try:
        exchange = SharedExchange.open(directory, floats, max_rank, overlap, sync)
    except ShmUnavailable as error:
        log.warning("%s: no shared memory for the exchange (%s); workers push over the job's sockets", who, error)
        return NO_SEGMENT
    log.info(
        "%s: exchange through shared memory %s (%.0f MB: the state's reply buffers and push slots of %s); "
        "a worker that cannot map it uses the job's socket",
        who,
        exchange.segment.path,
        exchange.segment.size / 1e6,
        words.counted(max_rank, "worker"),
    )
    return exchange
