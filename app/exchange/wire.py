"""What travels between a worker and the PS, besides tensors: the PS's answers to a join and
to a push, as small types (never a dict whose meaning depends on its keys).

Both sides import these from here (RPC pickles them by this module's name): the worker
does not reach into the PS's state machine (app/ps/server.py) for its wire types.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple, Union

import torch

from app.exchange.segment import Offer

Version = Union[int, tuple[int, ...]]  # a state's version: one per PS process (a tuple over shards)


class Progress(NamedTuple):
    """Where a rank is: `batch` batches of `epoch` done, `pushes` applied."""

    epoch: int
    batch: int
    pushes: int


class Joined(NamedTuple):
    """A PS process's answer to a worker's join: the state to start from and the rank's progress."""

    vector: torch.Tensor  # [params | buffers], or this process's slice of it
    version: int
    progress: Progress
    exchange: Offer | None = None  # this PS process's shared memory, for a worker on its host
    part: tuple[int, int] | None = None  # a sharded PS: the main PS's slice of the state
    shards: tuple[tuple[str, int, int], ...] = ()  # ... and each other shard's name and slice


class Taken(NamedTuple):
    """The answer to a join for a rank another running process holds."""

    message: str  # one line: which process holds it


class NotReady(NamedTuple):
    """The answer to a join while a sharded PS's shards are not all up: try again."""

    message: str


class Start(NamedTuple):
    """Where a worker starts from, whatever PS processes it joined."""

    vector: torch.Tensor  # the whole state
    version: Version
    progress: Progress


class Push(NamedTuple):
    """What a push says besides its values (a tensor over the socket, or the push slot they are
    in): who sends it, the state it was computed on and where the worker is once it is applied."""

    rank: int
    name: str  # the sending process's RPC name (a replaced process's push is refused)
    pulled: int  # the version of the receiving PS process's state the gradient comes from
    epoch: int = 1
    batch: int = 0  # batches of `epoch` done
    samples: int = 0  # the batch's size
    staleness: int | None = None  # a chained PS shard: the main PS's; None: the receiver's own
    finite: bool = False  # the worker found every value finite where it computed them (a GPU's flags)
    to_go: int = -1  # pushes the rank has still to make after this one, as planned now; -1: unknown
    grad_norm: float = -1.0  # the gradient's global L2 norm (train.clip_grad_norm); -1: not computed
    epoch_batches: int = 0  # the batches of one epoch over the whole training split (the schedule's plan)
    # The worker's training loss and samples/s as its last progress line gave them (every
    # train.log_every batches), sent once with the next push: the main PS logs them to MLflow.
    loss: float | None = None
    samples_per_s: float | None = None
    # The worker waits for each partition of its reply's state before its forward reads it
    # (app.exchange.streamed_pull): its PS may answer as soon as the first is written.
    streamed: bool = False


class Share(NamedTuple):
    """What a worker of a job that may be scaled trains next (app.ps.members.epochs): shard
    `shard` of `num_shards` of epoch `epoch`'s data (app.data.datasets.ShardSampler's), from its
    batch `skip` + 1 on (the batches before were trained by the process that held it)."""

    epoch: int
    shard: int
    num_shards: int
    skip: int = 0


class Reply(NamedTuple):
    """The PS's answer to a push."""

    vector: torch.Tensor  # the state to continue from: [params | buffers]
    version: Version  # its version (a tuple from a sharded PS)
    staleness: int  # updates applied between the pusher's pull and its push
    lead: int  # pushes the pusher is ahead of the slowest rank still training
    # A streamed reply (Push.streamed): the count of its region's word (app.exchange.progress)
    # before this state was written, which goes on to count its partitions as the PS writes them;
    # -1: the state was whole when the answer went.
    streamed: int = -1


class Refused(str, Enum):
    """Why the PS refused a call."""

    STALE = "stale"  # a newer process of the caller's rank replaced it: the caller exits
    NONFINITE = "nonfinite"  # the push held NaN or inf: the worker skips that batch


class Refusal(NamedTuple):
    """The PS's answer to a call it will not carry out (a value: RPC carries it as it is)."""

    kind: Refused
    message: str  # one line, naming the worker


class InSlot(NamedTuple):
    """A push's message that is in the worker's push slot `slot` of its PS process's segment
    (app.exchange.ps_end): `numel` values of `dtype`; only this crosses, not the values."""

    slot: int
    dtype: str  # e.g. float32, bfloat16
    numel: int


class SlotReply(NamedTuple):
    """The PS's answer to a push through shared memory (app.exchange.ps_end): the new state is in
    region `region` of the PS's segment, which the worker maps; nothing else crosses."""

    region: str  # e.g. reply1.0, round.1
    version: int
    staleness: int
    lead: int
    streamed: int = -1  # as Reply's


# The format of a push's values: float32, or (--compress) the gradients in 16 bits and the
# float32 buffers as pairs of 16-bit values (app.worker.compress.Compressor).

WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def wire_size(message_dtype: torch.dtype, num_params: int, size: int) -> int:
    """How many values a push of a `size`-value state with `num_params` parameters has:
    `size` in float32; in 16 bits the gradients take one value each and the float32
    buffers two (app.worker.compress.Compressor)."""
    return size if message_dtype == torch.float32 else num_params + 2 * (size - num_params)


def to_float32(message: torch.Tensor, num_params: int) -> torch.Tensor:
    """A pushed message as float32: as it is, or a 16-bit one's gradients widened and its
    buffers' bits read back as float32."""
    if message.dtype == torch.float32:
        return message
    return torch.cat([message[:num_params].float(), message[num_params:].clone().view(torch.float32)])


def finite_flag(values: torch.Tensor) -> torch.Tensor:
    """Whether `values` holds no NaN or inf, as a one-value bool tensor on their device, computed
    there (one sum, no host wait: a GPU worker copies the flag beside its values). True proves
    it: a NaN or inf anywhere makes the sum NaN or inf. False may also be a sum of finite values
    that overflowed: whoever reads a False checks the values themselves (`all_finite`)."""
    return torch.isfinite(values.sum())


def all_finite(message: torch.Tensor) -> bool:
    """No NaN or inf in `message`. A finite sum decides it in one pass (a NaN or inf in the
    message makes the sum NaN or inf); only when the sum is not finite is each value checked,
    as a sum of finite values can overflow."""
    return bool(torch.isfinite(message.sum())) or bool(torch.isfinite(message).all())
