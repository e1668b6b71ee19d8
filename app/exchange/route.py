"""A worker's route to its PS: the one object a worker's step goes through to reach the PS, one
kind per way of reaching a PS process, and what every kind shares.

A worker's trainer (app.worker.trainer) asks its route, chosen as it joined
(app.worker.channels.PSChannel.route), and nothing else of the exchange during a step:

    bind(model, flat, start, ...)   once: the start's state made the model's, and the model
                                    pointed where it reads its state and writes its gradient
    with backward():                around each backward (a GPU worker's copies start during it)
    seal(message) -> Outgoing       the message as it will travel (a GPU worker's copies queued)
    push(outgoing, version, ...)    sent now, or from the sender thread once its copies landed
        -> Pending
    Pending.wait()                  the PS's answer: a Reply whose state the model computes on
        -> Reply | Refusal          from here (loading it is part of the wait), or a Refusal

The kinds: `SharedMemoryRoute` (app.exchange.shared_route: the PS process's segment, mapped),
`SocketRoute` (app.exchange.socket_route: the job's socket) and `ShardedRoute`
(app.worker.sharded: a sharded PS, one route per shard under one). Here: the protocols, the
outgoing message, the worker a route pushes for (`Pusher`), the push sent now or once a GPU's
copies landed (`Pushing`), the pending answers, and what an answer raises (PSUnreachable; a
UsageError for a process a newer one replaced).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from app.config import UsageError
from app.contract import PS
from app.exchange.wire import Push, Refusal, Refused, Reply, Start, Version
from app.runtime.words import first_line
from app.training.flat import FlatModel

Call = Callable[..., Any]  # (to, function, args, timeout) -> the future of function(*args) on `to`


class PSUnreachable(RuntimeError):
    """A call to the PS failed (it died, or did not answer within rpc_timeout)."""


def unreachable(address: str, name: str, function: Callable[..., Any], error: BaseException) -> PSUnreachable:
    """The error to raise when `function` to PS process `name` failed: the PS (or one of its
    shards) is gone, or did not answer in time."""
    if name == PS:
        return PSUnreachable(f"lost the parameter server at {address} during {function.__name__}: {first_line(error)}")
    return PSUnreachable(
        f"lost parameter server shard {name} (job at {address}) during {function.__name__}: {first_line(error)}"
    )


def refused(answer: Any) -> Any:
    """The PS's answer, unless it refused because a newer process replaced this one
    (UsageError: exit 2); a `nonfinite` Refusal is returned for the caller to skip."""
    if isinstance(answer, Refusal) and answer.kind is Refused.STALE:
        raise UsageError(answer.message)
    return answer


class Pusher(NamedTuple):
    """The worker a route pushes for: its rank and process name, the job's address (named in
    errors), how long a push may take (rpc_timeout, plus the wait for the slowest worker under
    ssp and sync), its device and --overlap."""

    rank: int
    name: str = ""
    address: str = ""
    timeout: float = 60.0
    device: torch.device = torch.device("cpu")
    overlap: bool = False


class Outgoing(NamedTuple):
    """A push's message as it will travel, and what the push says of it. A GPU worker's message
    is still being copied where it travels from: the push is sent once `ready` has passed (the
    copy staged in pinned memory, or into its push slot `slot`), and then `flags` (pinned, one a
    partition) say whether every value is finite; a CPU worker's backward proves it in one flag
    (app.training.flat's `finite_proof`)."""

    message: torch.Tensor
    slot: int | None = None  # the push slot it is in already (a GPU worker copies it there)
    ready: Any = None  # torch.cuda.Event
    flags: torch.Tensor | None = None
    norm: torch.Tensor | None = None  # the gradient's global norm (train.clip_grad_norm), read once `ready` passed
    report: tuple[float, float] | None = None  # the worker's last loss and samples/s, not yet sent (Push.loss)

    def finite(self) -> bool:
        """Once `ready` has passed: whether the flags prove every value finite."""
        return self.flags is not None and bool(self.flags.all())


class Pending(Protocol):
    """A push on the wire: `wait()` gives the PS's answer, its state the model's."""

    def wait(self) -> Reply | Refusal: ...


class Route(Protocol):
    """A worker's way to its PS, whatever carries it: what the trainer asks of it."""

    def bind(
        self, model: nn.Module, flat: FlatModel, start: Start, final: bool, messages_here: bool, ordered: bool = True
    ) -> None: ...
    def backward(self) -> contextlib.AbstractContextManager[None]: ...
    def seal(self, message: torch.Tensor) -> Outgoing: ...
    def push(
        self,
        outgoing: Outgoing,
        version: Version,
        epoch: int = 1,
        batch: int = 0,
        samples: int = 0,
        to_go: int = -1,
        epoch_batches: int = 0,
    ) -> Pending: ...


class ProcessRoute(Route, Protocol):
    """The route to one PS process: its RPC name and the values start..end of the state it
    serves; a sharded PS's route (app.worker.sharded) sends each its part of a message (`own`,
    `send`) and takes its answer (`answer`), and its own `push` is the one process's whole."""

    name: str
    start: int
    end: int

    def own(self, part: torch.Tensor) -> torch.Tensor: ...
    def send(self, outgoing: Outgoing, push: Push) -> Any: ...
    def answer(self, future: Any) -> Reply | Refusal: ...
    def load(self, reply: Reply) -> None: ...


def flipped(flat: FlatModel | None, overlap: bool, device: torch.device, message: torch.Tensor) -> None:
    """With --overlap on the CPU, the next backward writes into the other message buffer, so the
    one sent stays intact on the wire."""
    assert flat is not None  # bound
    if overlap and message is flat.message and device.type == "cpu":
        flat.flip()


class Pushing:
    """`push`, for every route: the Push built, and sent now, or, for a message a GPU is still
    copying, from the sender thread once the copy has landed, so the training loop goes on
    launching the next step's kernels meanwhile (one push at a time, in order; the thread is made
    at the first such push). What is sent, and how its answer comes back, is the route's `go`."""

    def __init__(self, pusher: Pusher) -> None:
        self.pusher = pusher
        self.sender: ThreadPoolExecutor | None = None

    def push(
        self,
        outgoing: Outgoing,
        version: Version,
        epoch: int = 1,
        batch: int = 0,
        samples: int = 0,
        to_go: int = -1,
        epoch_batches: int = 0,
    ) -> Pending:
        """Send the push of `outgoing`, computed on the state of `version`; `.wait()` on the
        result gives the answer, its state loaded. `to_go`: the pushes the rank has still to make
        after this one (-1: unknown), for the main PS's progress; `epoch_batches`: the batches of
        one epoch over the whole training split (every PS process plans the run's schedule by it)."""
        rank, name = self.pusher.rank, self.pusher.name
        push = Push(rank, name, 0, epoch, batch, samples, to_go=to_go, epoch_batches=epoch_batches)
        if outgoing.report is not None:
            push = push._replace(loss=outgoing.report[0], samples_per_s=outgoing.report[1])
        if outgoing.ready is None:
            return self._now(outgoing, version, push)
        if self.sender is None:
            self.sender = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-send")
        return Deferred(self.sender.submit(self._landed, outgoing, version, push))

    def _landed(self, outgoing: Outgoing, version: Version, push: Push) -> Pending:
        outgoing.ready.synchronize()  # wait here, in the sender thread: the message is in host memory
        return self._now(outgoing, version, push)

    def _now(self, outgoing: Outgoing, version: Version, push: Push) -> Pending:
        if outgoing.norm is not None:  # on a GPU: copied to pinned memory before `ready`, no wait here
            push = push._replace(grad_norm=float(outgoing.norm))
        if outgoing.finite():  # the worker proved it (a GPU's flags, read once `ready` passed): no check there
            push = push._replace(finite=True)
        return self.go(outgoing, version, push)

    def go(self, outgoing: Outgoing, version: Version, push: Push) -> Pending:
        raise NotImplementedError


def to_one(route: ProcessRoute, outgoing: Outgoing, version: Version, push: Push) -> Answer:
    """The whole push to one PS process (`go` of a ProcessRoute), computed on its state of `version`."""
    pulled = version[0] if isinstance(version, tuple) else version
    return Answer(route, route.send(outgoing, push._replace(pulled=pulled)), outgoing.message)


class Answer:
    """A push on the wire to one PS process; holds its message until the answer came (RPC sends
    from it). `wait` takes the answer and loads a Reply's state."""

    def __init__(self, route: ProcessRoute, future: Any, message: torch.Tensor) -> None:
        self.route, self.future, self.message = route, future, message

    def wait(self) -> Reply | Refusal:
        answer = self.route.answer(self.future)
        if isinstance(answer, Reply):
            self.route.load(answer)
        return answer


class Deferred:
    """A push the sender thread sends once its copies have landed: `wait` waits for that, then
    for the PS's answer, in the caller's thread (what the send raised is raised here)."""

    def __init__(self, sent: Future) -> None:
        self.sent = sent

    def wait(self) -> Reply | Refusal:
        pending: Pending = self.sent.result()
        return pending.wait()


class Answered:
    """A push answered before it was sent (refused: non-finite); `wait` gives the answer."""

    def __init__(self, answer: Reply | Refusal) -> None:
        self.answer = answer

    def wait(self) -> Reply | Refusal:
        return self.answer
