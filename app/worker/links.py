"""A worker's link to one PS process: the way it reaches that process, chosen once, at join.

- `SharedMemoryLink`: the process's segment, mapped (app.exchange.worker_end, for a CPU and a
  GPU worker alike): a push's message is in a push slot and RPC carries which one (an InSlot);
  the reply's state is read where the PS wrote it.
- `SocketLink`: the job's socket carries the message as a tensor (a GPU worker's staged in pinned
  memory first) and the reply's state.

Both are a `Link`. The link of a PS of one process carries the whole push: it binds the model,
is around each backward, seals the message and loads the reply. A sharded PS's channel
(app.worker.channels) sends each link its part of the message (`own`, `send`, `answer`) and
carries the whole as RPC does (`Carried`). Nothing outside this module asks which link it has.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from app.exchange import calls, transport
from app.exchange.wire import InSlot, Joined, Push, Refusal, Reply, SlotReply
from app.exchange.worker_end import Sealed, WorkerEnd, attach
from app.training.flat import FlatModel

log = logging.getLogger("app.worker")
NOTHING_SEALED = Sealed()  # a push over the socket, or a CPU worker's (put in its slot when sent)
Call = Callable[..., Any]  # (to, function, args, timeout) -> the future of function(*args) on `to`


class Outgoing(NamedTuple):
    """A push's message as it will travel, and what the push says of it (app.exchange.worker_end).
    `ready`: a GPU worker's message is still being copied where it travels from; the push is
    sent once this event has passed (the copy staged in pinned memory, or the slot's)."""

    message: torch.Tensor
    sealed: Sealed = NOTHING_SEALED
    ready: Any = None  # torch.cuda.Event
    norm: torch.Tensor | None = None  # the gradient's global norm (train.clip_grad_norm), read once `ready` passed

    def event(self) -> Any:
        return self.ready if self.ready is not None else self.sealed.ready


class Whole(Protocol):
    """The model's side of a whole push: where the model reads its state and writes its gradient."""

    def bind(
        self, model: nn.Module, flat: FlatModel, who: str, final: bool, messages_here: bool, ordered: bool = True
    ) -> None: ...
    def backward(self) -> contextlib.AbstractContextManager[None]: ...
    def seal(self, message: torch.Tensor) -> Outgoing: ...
    def load(self, reply: Reply) -> None: ...


class Link(Whole, Protocol):
    """One PS process, as this worker reaches it: its RPC name and the values start..end of the
    state it serves."""

    name: str
    start: int
    end: int

    def own(self, part: torch.Tensor) -> torch.Tensor: ...
    def send(self, message: torch.Tensor, push: Push, sealed: Sealed, timeout: float) -> Any: ...
    def answer(self, future: Any) -> Reply | Refusal: ...


def flipped(flat: FlatModel | None, overlap: bool, device: torch.device, message: torch.Tensor) -> None:
    """With --overlap on the CPU, the next backward writes into the other message buffer, so the
    one sent stays intact on the wire."""
    assert flat is not None  # bound
    if overlap and message is flat.message and device.type == "cpu":
        flat.flip()


class Carried:
    """A whole push whose message RPC carries as a tensor (a socket link's, or a sharded PS's
    every part): a GPU worker stages it in pinned memory (RPC carries CPU tensors only), and the
    reply's state is adopted as it arrived."""

    def __init__(self, device: torch.device, overlap: bool) -> None:
        self.device, self.overlap = device, overlap
        self.flat: FlatModel | None = None
        # two buffers, used by pushes sent in turn: with --overlap one is on the wire while the next fills
        self.staging: list[torch.Tensor] | None = None
        self.staged = 0  # messages sealed (each is sent)

    def bind(
        self, model: nn.Module, flat: FlatModel, who: str, final: bool, messages_here: bool, ordered: bool = True
    ) -> None:
        self.flat = flat
        if self.device.type == "cuda":
            size = flat.message.numel()  # the widest message: float32 (16-bit ones are smaller)
            self.staging = [torch.empty(size, dtype=torch.float32, pin_memory=True) for _ in range(2)]

    def backward(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def seal(self, message: torch.Tensor) -> Outgoing:
        """Staged in pinned memory (a GPU worker: copied on the compute stream, not waited for
        here), or as it is."""
        if self.staging is not None:  # the other buffer may still be on the wire
            staged = self.staging[self.staged % 2].view(message.dtype)[: message.numel()]
            self.staged += 1
            staged.copy_(message, non_blocking=True)  # pinned: no host wait
            if not message.is_cuda:
                return Outgoing(staged)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(message.device))
            return Outgoing(staged, ready=ready)
        flipped(self.flat, self.overlap, self.device, message)
        return Outgoing(message)

    def load(self, reply: Reply) -> None:
        assert self.flat is not None  # bound
        self.flat.adopt(reply.vector)


class SocketLink(Carried):
    """A PS process reached over the job's socket: the message and the reply's state cross as tensors."""

    def __init__(
        self, name: str, start: int, end: int, device: torch.device, overlap: bool, call: Call = transport.call_async
    ) -> None:
        super().__init__(device, overlap)
        self.name, self.start, self.end, self.call = name, start, end, call

    def own(self, part: torch.Tensor) -> torch.Tensor:
        """A part of a message as it travels: a contiguous copy, only its own bytes."""
        return part.clone()

    def send(self, message: torch.Tensor, push: Push, sealed: Sealed, timeout: float) -> Any:
        return self.call(self.name, calls.rpc_push, (message, push), timeout)

    def answer(self, future: Any) -> Reply | Refusal:
        answer: Reply | Refusal = future.wait()
        return answer


class SharedMemoryLink:
    """A PS process whose segment this worker mapped: the message goes in a push slot (its
    backward writes it there on the CPU, a GPU worker copies it there), RPC carries which slot, and
    the reply's state is read where the PS wrote it (app.exchange.worker_end)."""

    def __init__(
        self,
        name: str,
        start: int,
        end: int,
        shared: WorkerEnd,
        overlap: bool,
        call: Call = transport.call_async,
    ) -> None:
        self.name, self.start, self.end, self.shared, self.call = name, start, end, shared, call
        self.overlap = overlap
        self.flat: FlatModel | None = None

    def bind(
        self, model: nn.Module, flat: FlatModel, who: str, final: bool, messages_here: bool, ordered: bool = True
    ) -> None:
        """The model pointed at the segment (app.exchange.worker_end.WorkerEnd.bind: `final`, a GPU
        worker's copies during the backward; `messages_here`, float32 messages written into the
        push slots; `ordered`, the ordered pull)."""
        self.flat = flat
        self.shared.bind(model, flat, who, final, messages_here, ordered)

    def backward(self) -> contextlib.AbstractContextManager[None]:
        return self.shared.backward()

    def seal(self, message: torch.Tensor) -> Outgoing:
        """In its push slot (a GPU worker's copies into it run on a side stream:
        app.exchange.slot_copies), or put there when it is sent."""
        flipped(self.flat, self.overlap, self.shared.device, message)
        return Outgoing(message, self.shared.seal(message))

    def load(self, reply: Reply) -> None:
        self.shared.load(reply)

    def own(self, part: torch.Tensor) -> torch.Tensor:
        """A part of a message as it travels: a view (`send` copies it into a push slot)."""
        return part

    def send(self, message: torch.Tensor, push: Push, sealed: Sealed, timeout: float) -> Any:
        """The push, its message in a push slot: the slot's number crosses, not the values."""
        if sealed.finite():  # a GPU's flags, read once its copies landed: the PS need not check
            push = push._replace(finite=True)
        dtype = str(message.dtype).removeprefix("torch.")
        slot = InSlot(self.shared.slot_for(message, sealed), dtype, message.numel())
        return self.call(self.name, calls.rpc_push, (slot, push), timeout)

    def answer(self, future: Any) -> Reply | Refusal:
        """A Reply whose state is the region the PS wrote it in (no copy)."""
        answer = future.wait()
        return self.shared.reply(answer) if isinstance(answer, SlotReply) else answer


def connect(
    joined: Joined,
    part: tuple[str, int, int],
    rank: int,
    device: torch.device,
    mode: str,
    who: str,
    overlap: bool,
) -> Link:
    """The link to the PS process `part` names (its name, start, end), chosen once as it joined:
    its shared memory where its answer offers a segment this worker can map (`mode` auto), else
    the job's socket."""
    name, start, end = part
    shared = attach(joined.exchange, rank, device, mode, who, name)
    if shared is None:
        return SocketLink(name, start, end, device, overlap)
    return SharedMemoryLink(name, start, end, shared, overlap)
