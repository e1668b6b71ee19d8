"""A worker's channel to its PS: join, push and pull, finish, leave, the next epoch's share.

The trainer (app.worker.trainer) holds a `Channel` and nothing else of the PS. `PSChannel` is
the one kind there is: its PS is one process or a sharded PS's K processes
(app.ps.sharding.slices), each a `Route` that serves a slice of the state vector. A push sends
each route its slice, over the route's shared memory where the worker could map it at join
(app.exchange.worker_end: the message in a push slot, RPC carries only which one), else over
TensorPipe as a tensor; the answers come back as one Reply (or a Refusal).

- One PS process: the reply's state is used where it arrived (the PS's reply buffer in shared
  memory, or the tensor RPC received), and where the PS applies partitions early the worker's
  backward notes them as it finishes them (the route's end does it).
- A sharded PS: a non-finite message is refused here, before any shard applies a slice of it;
  with `chained` (--staleness_lr) the main PS's slice goes first and the others follow once it
  answered, with its staleness, so every slice of a push is scaled alike; otherwise every slice
  goes at once. The reply is the slices put together (one copy), its version a tuple, its
  staleness and lead the main PS's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from app.config import UsageError
from app.contract import PS, worker_name
from app.exchange import calls, group, transport
from app.exchange.group import READY_KEY
from app.exchange.wire import (
    InSlot,
    Joined,
    NotReady,
    Push,
    Refusal,
    Refused,
    Reply,
    Share,
    SlotReply,
    Start,
    Taken,
    Version,
    all_finite,
)
from app.exchange.worker_end import Sealed, WorkerEnd, attach
from app.runtime.words import first_line
from app.training.flat import FlatModel
from app.worker.compress import Compressor

NOT_IN_GROUP_YET = "could not find destination name"
POLL_SECONDS = 0.1
NOTHING_SEALED = Sealed()  # a push through TensorPipe, or one that noted nothing
Slice = tuple["Route", torch.Tensor, int]  # a route, its part of a message, the version of its state pulled


class Pending(Protocol):
    """A push on the wire: `wait()` gives the PS's answer."""

    def wait(self) -> Reply | Refusal: ...


class Channel(Protocol):
    """What the trainer asks of its PS (app.worker.trainer), whatever carries it."""

    name: str

    def join(self) -> Start: ...
    def bind(self, model: nn.Module, flat: FlatModel, start: Start, notes: bool, messages_here: bool) -> None: ...
    def backward(self, version: Version) -> contextlib.AbstractContextManager[None]: ...
    def seal(self, message: torch.Tensor) -> Outgoing: ...
    def send(
        self,
        outgoing: Outgoing,
        version: Version,
        epoch: int,
        batch: int,
        samples: int,
        to_go: int = -1,
        epoch_batches: int = 0,
    ) -> Pending: ...
    def load(self, reply: Reply) -> None: ...
    def finish(self, pushes: int) -> None: ...
    def leave(self, pushes: int) -> None: ...
    def share(self, finished: Share | None) -> Share | None: ...


class PSUnreachable(RuntimeError):
    """A call to the PS failed (it died, or did not answer within rpc_timeout)."""


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


@dataclass
class Route:
    """One PS process: its RPC name, the values start..end of the state it serves, and its
    shared memory where this worker mapped it."""

    name: str
    start: int
    end: int
    end_of_link: WorkerEnd | None = None


def wait_until_ready(master_addr: str, master_port: int, timeout: float) -> None:
    """Before a worker of a sharded PS joins the RPC group: until every shard has registered with
    the main PS (so the join makes this process known to every shard, and them to it)."""
    store = group.connect(master_addr, master_port, timeout)
    deadline = time.monotonic() + timeout
    while not store.check([READY_KEY]):
        if time.monotonic() > deadline:
            raise group.StoreUnreachable(
                f"the parameter server at {master_addr}:{master_port} did not get all its shards within {timeout:.0f} s"
            )
        time.sleep(POLL_SECONDS)


def call_joining(to: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
    """`transport.call` of a worker's join to `to` (the PS or a shard). A worker can enter the RPC
    group before `to` has (the PS hosts the group's store, then enters it): `to` tells every
    member of itself as it enters, and until then RPC cannot find its name, so the call is tried
    again every 0.1 s, within `timeout`; any other error, or that one past `timeout`, raises."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return transport.call(to, function, args, timeout=timeout)
        except RuntimeError as error:
            if NOT_IN_GROUP_YET not in str(error) or time.monotonic() >= deadline:
                raise
            time.sleep(POLL_SECONDS)


def refused(answer: Any) -> Any:
    """The PS's answer, unless it refused because a newer process replaced this one
    (UsageError: exit 2); a `nonfinite` Refusal is returned for the caller to skip."""
    if isinstance(answer, Refusal) and answer.kind is Refused.STALE:
        raise UsageError(answer.message)
    return answer


class PSChannel:
    """The channel to one PS process or to a sharded PS's every process; every call bounded by
    rpc_timeout (a push under ssp or sync may also wait `push_wait` for the slowest worker).
    `exchange`: auto (shared memory where a PS process offers it and this process can map it)
    or tensorpipe. `sharded`: the worker was started for a sharded PS (--shards K > 1)."""

    def __init__(
        self,
        rank: int,
        timeout: float,
        address: str,
        name: str = "",
        push_wait: float = 0.0,
        exchange: str = "auto",
        device: torch.device | None = None,
        sharded: bool = False,
        chained: bool = False,
        overlap: bool = False,
    ) -> None:
        self.rank, self.timeout, self.address = rank, timeout, address
        self.name = name or worker_name(rank)
        self.push_timeout = timeout + push_wait
        self.exchange, self.device = exchange, device or torch.device("cpu")
        self.sharded, self.chained, self.overlap = sharded, chained, overlap
        self.routes: list[Route] = []
        self.flat: FlatModel | None = None
        # RPC carries CPU tensors only: a GPU worker whose message does not go into a push slot
        # stages it here (two buffers, used by pushes sent in turn: with --overlap one is on the
        # wire while the next fills).
        self.staging: list[torch.Tensor] | None = None
        self.sent = 0  # pushes sent by this process
        # A GPU worker's pushes are sent from this thread, each once its copies have landed, so the
        # training loop goes on launching the next step's kernels meanwhile (one push at a time,
        # in order). Made at the first such push.
        self.sender: ThreadPoolExecutor | None = None

    # Joining: the routes, and the state to start from.

    def join(self) -> Start:
        """The state to start from and this rank's progress (the main PS is the authority on
        it); UsageError if the rank is taken, PSUnreachable if the PS cannot be reached or its
        shards are not all up. Maps each PS process's shared memory where it offers it."""
        joined = self._join(PS, lost=self.lost)
        if isinstance(joined, Taken):
            raise UsageError(joined.message)
        if isinstance(joined, NotReady):  # a shard restarts: start again once it is back
            raise self.lost(PS, calls.rpc_join, RuntimeError(joined.message))
        if self.sharded and joined.part is None:
            raise RuntimeError("the parameter server answered as one process; this worker was started with shards")
        start, end = joined.part or (0, joined.vector.numel())
        self.routes = [Route(PS, start, end, self._attach(joined, PS))]
        slices, versions = [joined.vector], [joined.version]
        for name, start, end in joined.shards:
            got = self._join(name, lost=self.lost)
            if not isinstance(got, Joined):
                raise UsageError(got.message)
            self.routes.append(Route(name, start, end, self._attach(got, name)))
            slices.append(got.vector)
            versions.append(got.version)
        if len(self.routes) == 1:
            return Start(joined.vector, joined.version, joined.progress)
        return Start(torch.cat(slices), tuple(versions), joined.progress)

    def _join(self, name: str, lost: Callable[..., Exception]) -> Joined | Taken | NotReady:
        try:
            return call_joining(name, calls.rpc_join, (self.rank, self.name), self.timeout)
        except RuntimeError as error:
            raise lost(name, calls.rpc_join, error) from error

    def _attach(self, joined: Joined, peer: str) -> WorkerEnd | None:
        return attach(joined.exchange, self.rank, self.device, self.exchange, self.name, peer)

    # The model's side: where it reads its state and writes its gradient.

    def bind(self, model: nn.Module, flat: FlatModel, start: Start, notes: bool, messages_here: bool) -> None:
        """Make `start`'s state the model's; one PS process reached through shared memory gets
        the model pointed at it (app.exchange.worker_end.WorkerEnd.bind: `notes`, the early
        push; `messages_here`, float32 messages written into the push slots)."""
        self.flat = flat
        flat.adopt(start.vector)
        end = self._single_end()
        if end is not None:
            end.bind(model, flat, self.name, notes, messages_here)
        if self.device.type == "cuda" and end is None:
            size = flat.message.numel()  # the widest message: float32 (16-bit ones are smaller)
            self.staging = [torch.empty(size, dtype=torch.float32, pin_memory=True) for _ in range(2)]

    def _single_end(self) -> WorkerEnd | None:
        """The shared memory of the one PS process this worker pushes to; None for a sharded PS
        (each shard takes its slice of the message: no one slot holds a whole push)."""
        return self.routes[0].end_of_link if len(self.routes) == 1 else None

    @contextlib.contextmanager
    def backward(self, version: Version) -> Iterator[None]:
        """Around one backward from the state of `version`."""
        end = self._single_end()
        if end is None:
            yield
            return
        assert isinstance(version, int)  # one PS process's
        with end.backward(version):
            yield

    def seal(self, message: torch.Tensor) -> Outgoing:
        """The message as it will travel: staged in pinned memory (a GPU worker over
        TensorPipe: copied on the compute stream, not waited for here), or in its push slot (a
        GPU worker's copies into it run on a side stream: app.exchange.slot_copies); with
        --overlap on the CPU, the next backward writes into the other message buffer, so the
        one sent stays intact on the wire."""
        end = self._single_end()
        if self.staging is not None:  # the other buffer may still be on the wire
            staged = self.staging[self.sent % 2].view(message.dtype)[: message.numel()]
            staged.copy_(message, non_blocking=True)  # pinned: no host wait
            if not message.is_cuda:
                return Outgoing(staged)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(message.device))
            return Outgoing(staged, ready=ready)
        assert self.flat is not None  # bound
        if self.overlap and message is self.flat.message and self.device.type == "cpu":
            self.flat.flip()
        return Outgoing(message, end.seal(message) if end is not None else Sealed())

    def load(self, reply: Reply) -> None:
        """Continue from the reply's state (no copy where it can be used where it is)."""
        end = self._single_end()
        if end is not None:
            end.load(reply)
        else:
            assert self.flat is not None  # bound
            self.flat.adopt(reply.vector)

    # The push: one path for one PS process and for a sharded PS's every process.

    def send(
        self,
        outgoing: Outgoing,
        version: Version,
        epoch: int = 1,
        batch: int = 0,
        samples: int = 0,
        to_go: int = -1,
        epoch_batches: int = 0,
    ) -> Pending:
        """Send the push (to the main PS only first, when chained): now, or, for a message a GPU
        is still copying, from the sender thread once the copy has landed; `.wait()` on the
        result gives the Reply. A sharded PS's push that holds NaN or inf is refused here.
        `to_go`: the pushes the rank has still to make after this one (-1: unknown), for the
        main PS's progress; `epoch_batches`: the batches of one epoch over the whole training
        split (every PS process plans the run's schedule by it)."""
        self.sent += 1
        push = Push(self.rank, self.name, 0, epoch, batch, samples, to_go=to_go, epoch_batches=epoch_batches)
        ready = outgoing.event()
        if ready is None:
            return self._send_now(outgoing, version, push)
        if self.sender is None:
            self.sender = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-send")
        return Deferred(self.sender.submit(self._send_landed, ready, outgoing, version, push))

    def _send_landed(self, ready: Any, outgoing: Outgoing, version: Version, push: Push) -> Pending:
        ready.synchronize()  # wait here, in the sender thread: the message is in host memory
        return self._send_now(outgoing, version, push)

    def _send_now(self, outgoing: Outgoing, version: Version, push: Push) -> Pending:
        message = outgoing.message
        if len(self.routes) > 1 and not self._finite(message):
            why = f"{self.name} computed non-finite values (NaN or inf); the push was not sent"
            return Answered(Refusal(Refused.NONFINITE, why))
        if outgoing.norm is not None:  # on a GPU: copied to pinned memory before `ready`, no wait here
            push = push._replace(grad_norm=float(outgoing.norm))
        versions = version if isinstance(version, tuple) else (version,)
        sends = [(route, self._part(message, route), pulled) for route, pulled in zip(self.routes, versions)]
        rest = sends[1:] if self.chained else []
        now = sends[: len(sends) - len(rest)]
        futures = [
            (route, self._send(route, part, push._replace(pulled=pulled), outgoing.sealed))
            for route, part, pulled in now
        ]
        return PendingPush(self, futures, rest, push._replace(to_go=-1), message)

    def _finite(self, message: torch.Tensor) -> bool:
        assert self.flat is not None  # bound
        return all_finite(message[: self.flat.num_params] if message.dtype != torch.float32 else message)

    def _part(self, message: torch.Tensor, route: Route) -> torch.Tensor:
        """The route's values of the message: all of it (one PS process), or values
        start..end (a view: shared memory copies it into the slot; TensorPipe sends a
        contiguous copy, only its own bytes)."""
        if len(self.routes) == 1:
            return message
        if message.dtype != torch.float32:  # --compress (app.worker.compress.Compressor)
            assert self.flat is not None  # bound
            part = Compressor.slice(message, self.flat.num_params, route.start, route.end)
        else:
            part = message[route.start : route.end]
        return part if route.end_of_link is not None else part.clone()

    def _send(self, route: Route, part: torch.Tensor, push: Push, sealed: Sealed = NOTHING_SEALED) -> Any:
        """The RPC future of `push` to `route`: through its push slot, or as a tensor."""
        end = route.end_of_link
        try:
            if end is not None:
                if sealed.backward is not None:
                    push = push._replace(backward=sealed.backward, noted=sealed.noted)
                if sealed.finite():  # a GPU's flags, read once its copies landed: the PS need not check
                    push = push._replace(finite=True)
                dtype = str(part.dtype).removeprefix("torch.")
                slot = InSlot(end.slot_for(part, sealed), dtype, part.numel())
                return self.call_async(route.name, calls.rpc_push, (slot, push))
            return self.call_async(route.name, calls.rpc_push, (part, push))
        except RuntimeError as error:
            raise self.lost(route.name, calls.rpc_push, error) from error

    def call_async(self, to: str, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """The RPC future of `function(*args)` on `to` (a push: it may wait `push_wait` too)."""
        return transport.call_async(to, function, args, timeout=self.push_timeout)

    def send_rest(self, rest: list[Slice], push: Push, staleness: int) -> list[tuple[Route, Any]]:
        """A chained push's other slices, once the main PS answered with `staleness`."""
        return [
            (route, self._send(route, part, push._replace(pulled=pulled, staleness=staleness)))
            for route, part, pulled in rest
        ]

    def answer(self, route: Route, future: Any) -> Reply | Refusal:
        """The answer of `route` to a push: a Reply whose state is where it arrived."""
        try:
            answer = future.wait()
        except RuntimeError as error:
            raise self.lost(route.name, calls.rpc_push, error) from error
        if isinstance(answer, SlotReply) and route.end_of_link is not None:
            return route.end_of_link.reply(answer)
        return refused(answer)

    # The rest of a worker's calls.

    def finish(self, pushes: int) -> None:
        """The other shards first: once the main PS hears the last finish, it ends them."""
        for route in self.routes[1:]:
            refused(self._call(route.name, calls.rpc_finish, self.rank, pushes, self.name))
        refused(self._call(PS, calls.rpc_finish, self.rank, pushes, self.name))

    def leave(self, pushes: int) -> None:
        """Leave the job for good (scaled down): the other shards first, then the main PS (which
        records it); the PS stops waiting for this rank."""
        for route in self.routes[1:]:
            refused(self._call(route.name, calls.rpc_leave, self.rank, pushes, self.name))
        refused(self._call(PS, calls.rpc_leave, self.rank, pushes, self.name))

    def share(self, finished: Share | None) -> Share | None:
        """What this rank trains next, having trained `finished` (None: this process starts);
        None: nothing is left (app.ps.members.epochs)."""
        return self._call(PS, calls.rpc_share, self.rank, finished)

    def _call(self, name: str, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return transport.call(name, function, args, timeout=self.timeout)
        except RuntimeError as error:
            raise self.lost(name, function, error) from error

    def lost(self, name: str, function: Callable[..., Any], error: BaseException) -> PSUnreachable:
        """The error to raise when `function` failed: the PS (or one of its shards) is gone, or
        did not answer in time."""
        if name == PS:
            return PSUnreachable(
                f"lost the parameter server at {self.address} during {function.__name__}: {first_line(error)}"
            )
        return PSUnreachable(
            f"lost parameter server shard {name} (job at {self.address}) "
            f"during {function.__name__}: {first_line(error)}"
        )


class Deferred:
    """A push the sender thread sends once its copies have landed: `wait` waits for that, then
    for the PS's answer (what the send raised is raised here)."""

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


class PendingPush:
    """A push on the wire to each route; holds its message until the replies came (RPC sends from
    it). `wait` gives one Reply for the whole vector (staleness and lead: the main PS's); `rest`:
    the slices still to send once the main PS answered, with its staleness (chained), as `push`
    says."""

    def __init__(
        self,
        channel: PSChannel,
        futures: list[tuple[Route, Any]],
        rest: list[Slice],
        push: Push,
        message: torch.Tensor,
    ) -> None:
        self.channel, self.futures, self.rest, self.push, self.message = channel, futures, rest, push, message

    def wait(self) -> Reply | Refusal:
        first = self.channel.answer(*self.futures[0])
        if isinstance(first, Refusal) or len(self.futures) + len(self.rest) == 1:
            return first
        sent = self.channel.send_rest(self.rest, self.push, first.staleness) if self.rest else []
        replies = [first] + [self.channel.answer(route, future) for route, future in self.futures[1:] + sent]
        done = []
        for reply in replies:
            if isinstance(reply, Refusal):
                return reply
            done.append(reply)
        vector = torch.cat([r.vector for r in done])
        versions = tuple(v for r in done for v in (r.version if isinstance(r.version, tuple) else (r.version,)))
        return Reply(vector, versions, first.staleness, first.lead)
