"""A push whose message crosses as a tensor: `Carried`, the model's side of it (a GPU worker's
message staged in pinned memory, the reply's state adopted as it arrived), and `SocketRoute`,
a worker's route (app.exchange.route) to a PS process over the job's socket. A sharded PS's
route (app.worker.sharded) carries its whole push as `Carried` too.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from app.contract import PS
from app.exchange import calls, transport
from app.exchange.route import Call, Outgoing, Pending, Pusher, Pushing, flipped, refused, to_one, unreachable
from app.exchange.wire import Push, Refusal, Reply, Start, Version
from app.training.flat import FlatModel


class Carried(Pushing):
    """The model's side of a push whose message RPC carries as a tensor (a socket route's, or a
    sharded PS's every part): a GPU worker stages it in pinned memory (RPC carries CPU tensors
    only), and the reply's state is adopted as it arrived."""

    def __init__(self, pusher: Pusher) -> None:
        super().__init__(pusher)
        self.flat: FlatModel | None = None
        # two buffers, used by pushes sent in turn: with --overlap one is on the wire while the next fills
        self.staging: list[torch.Tensor] | None = None
        self.staged = 0  # messages sealed (each is sent)

    def bind(
        self, model: nn.Module, flat: FlatModel, start: Start, final: bool, messages_here: bool, ordered: bool = True
    ) -> None:
        """`start`'s state made the model's; a GPU worker's staging buffers."""
        self.flat = flat
        flat.adopt(start.vector)
        if self.pusher.device.type == "cuda":
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
        flipped(self.flat, self.pusher.overlap, self.pusher.device, message)
        return Outgoing(message)

    def load(self, reply: Reply) -> None:
        """Continue from the reply's state, as it arrived."""
        assert self.flat is not None  # bound
        self.flat.adopt(reply.vector)


class SocketRoute(Carried):
    """A PS process reached over the job's socket: the message and the reply's state cross as
    tensors. `name`, `start`, `end`: the process and the values of the state it serves."""

    def __init__(
        self, pusher: Pusher, name: str = PS, start: int = 0, end: int = 0, call: Call = transport.call_async
    ) -> None:
        super().__init__(pusher)
        self.name, self.start, self.end, self.call = name, start, end, call

    def go(self, outgoing: Outgoing, version: Version, push: Push) -> Pending:
        return to_one(self, outgoing, version, push)

    def own(self, part: torch.Tensor) -> torch.Tensor:
        """A part of a message as it travels: a contiguous copy, only its own bytes."""
        return part.clone()

    def send(self, outgoing: Outgoing, push: Push) -> Any:
        """The RPC future of the push, its message as a tensor."""
        try:
            return self.call(self.name, calls.rpc_push, (outgoing.message, push), self.pusher.timeout)
        except RuntimeError as error:
            raise unreachable(self.pusher.address, self.name, calls.rpc_push, error) from error

    def answer(self, future: Any) -> Reply | Refusal:
        """The answer to a push: a Reply whose state is where it arrived."""
        try:
            answer = future.wait()
        except RuntimeError as error:
            raise unreachable(self.pusher.address, self.name, calls.rpc_push, error) from error
        return refused(answer)
