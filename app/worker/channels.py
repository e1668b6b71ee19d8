"""A worker's channel to its PS: join, push and pull, finish, leave, the next epoch's share.

The trainer (app.worker.trainer) holds a `Channel` and nothing else of the PS. `PSChannel` is
the one kind there is: its PS is one process or a sharded PS's K processes
(app.ps.sharding.slices), each reached through a link (app.worker.links: shared memory or
the job's socket, chosen once as it joins) that serves a slice of the state vector. The channel only
shards; the answers come back as one Reply (or a Refusal).

- One PS process: its link carries the whole push (binds the model, is around each backward,
  seals the message, loads the reply).
- A sharded PS: the channel carries the whole as RPC does (app.worker.links.Carried) and sends
  each link its slice; a non-finite message is refused here, before any shard applies a slice of
  it; with `chained` (--staleness_lr) the main PS's slice goes first and the others follow once
  it answered, with its staleness, so every slice of a push is scaled alike; otherwise every
  slice goes at once. The reply is the slices put together (one copy), its version a tuple, its
  staleness and lead the main PS's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch import nn

from app.config import Config, UsageError
from app.contract import PS, worker_name
from app.exchange import calls, group, transport
from app.exchange.group import READY_KEY
from app.exchange.wire import Joined, NotReady, Push, Refusal, Refused, Reply, Share, Start, Taken, Version, all_finite
from app.exchange.worker_end import Sealed
from app.runtime.words import first_line
from app.training.flat import FlatModel
from app.worker.compress import Compressor
from app.worker.links import NOTHING_SEALED, Carried, Link, Outgoing, connect

NOT_IN_GROUP_YET = "could not find destination name"
POLL_SECONDS = 0.1
Slice = tuple[Link, torch.Tensor, int]  # a link, its part of a message, the version of its state pulled


class Pending(Protocol):
    """A push on the wire: `wait()` gives the PS's answer."""

    def wait(self) -> Reply | Refusal: ...


class Channel(Protocol):
    """What the trainer asks of its PS (app.worker.trainer), whatever carries it."""

    name: str

    def join(self) -> Start: ...
    def bind(
        self, model: nn.Module, flat: FlatModel, start: Start, final: bool, messages_here: bool, ordered: bool = True
    ) -> None: ...
    def backward(self) -> contextlib.AbstractContextManager[None]: ...
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


def wait_until_ready(config: Config, timeout: float) -> None:
    """Before a worker of a sharded PS joins the job: until every shard has registered with the
    main PS (so the join makes this process known to every shard, and them to it)."""
    deadline = time.monotonic() + timeout
    with transport.store(config, timeout) as store:
        while not store.check([READY_KEY]):
            if time.monotonic() > deadline:
                raise group.StoreUnreachable(
                    f"the parameter server at {group.where(config)} did not get all its shards within {timeout:.0f} s"
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
    or transport. `sharded`: the worker was started for a sharded PS (--shards K > 1)."""

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
        self.links: list[Link] = []
        self.flat: FlatModel | None = None
        self.carried = Carried(self.device, overlap)  # a sharded PS's whole push
        # A GPU worker's pushes are sent from this thread, each once its copies have landed, so the
        # training loop goes on launching the next step's kernels meanwhile (one push at a time,
        # in order). Made at the first such push.
        self.sender: ThreadPoolExecutor | None = None

    # Joining: the links, and the state to start from.

    def join(self) -> Start:
        """The state to start from and this rank's progress (the main PS is the authority on
        it); UsageError if the rank is taken, PSUnreachable if the PS cannot be reached or its
        shards are not all up. Each PS process's link is chosen as it is joined."""
        joined = self._join(PS, lost=self.lost)
        if isinstance(joined, Taken):
            raise UsageError(joined.message)
        if isinstance(joined, NotReady):  # a shard restarts: start again once it is back
            raise self.lost(PS, calls.rpc_join, RuntimeError(joined.message))
        if self.sharded and joined.part is None:
            raise RuntimeError("the parameter server answered as one process; this worker was started with shards")
        start, end = joined.part or (0, joined.vector.numel())
        self.links = [self._link(joined, (PS, start, end))]
        slices, versions = [joined.vector], [joined.version]
        for name, start, end in joined.shards:
            got = self._join(name, lost=self.lost)
            if not isinstance(got, Joined):
                raise UsageError(got.message)
            self.links.append(self._link(got, (name, start, end)))
            slices.append(got.vector)
            versions.append(got.version)
        if len(self.links) == 1:
            return Start(joined.vector, joined.version, joined.progress)
        return Start(torch.cat(slices), tuple(versions), joined.progress)

    def _join(self, name: str, lost: Callable[..., Exception]) -> Joined | Taken | NotReady:
        try:
            return call_joining(name, calls.rpc_join, (self.rank, self.name), self.timeout)
        except RuntimeError as error:
            raise lost(name, calls.rpc_join, error) from error

    def _link(self, joined: Joined, part: tuple[str, int, int]) -> Link:
        return connect(joined, part, self.rank, self.device, self.exchange, self.name, self.overlap)

    # The model's side: where it reads its state and writes its gradient.

    def whole(self) -> Link | Carried:
        """What carries a whole push: the one PS process's link, or, for a sharded PS, RPC (each
        shard takes its slice of the message: no one link holds a whole push)."""
        return self.links[0] if len(self.links) == 1 else self.carried

    def bind(
        self, model: nn.Module, flat: FlatModel, start: Start, final: bool, messages_here: bool, ordered: bool = True
    ) -> None:
        """Make `start`'s state the model's, and point the model where its pushes travel from
        (`final`: a GPU worker's gradient copied out as the backward finishes it; `messages_here`:
        float32 messages, written where they travel;
        `ordered`: a GPU worker's replies taken back as its forward needs them, else whole)."""
        self.flat = flat
        flat.adopt(start.vector)
        self.whole().bind(model, flat, self.name, final, messages_here, ordered)

    def backward(self) -> contextlib.AbstractContextManager[None]:
        """Around one backward."""
        return self.whole().backward()

    def seal(self, message: torch.Tensor) -> Outgoing:
        """The message as it will travel (a GPU worker's: its copies queued, not waited for)."""
        return self.whole().seal(message)

    def load(self, reply: Reply) -> None:
        """Continue from the reply's state (no copy where it can be used where it is)."""
        self.whole().load(reply)

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
        if len(self.links) > 1 and not self._finite(message):
            why = f"{self.name} computed non-finite values (NaN or inf); the push was not sent"
            return Answered(Refusal(Refused.NONFINITE, why))
        if outgoing.norm is not None:  # on a GPU: copied to pinned memory before `ready`, no wait here
            push = push._replace(grad_norm=float(outgoing.norm))
        versions = version if isinstance(version, tuple) else (version,)
        sends = [(link, self._part(message, link), pulled) for link, pulled in zip(self.links, versions)]
        rest = sends[1:] if self.chained else []
        now = sends[: len(sends) - len(rest)]
        futures = [
            (link, self._send(link, part, push._replace(pulled=pulled), outgoing.sealed)) for link, part, pulled in now
        ]
        return PendingPush(self, futures, rest, push._replace(to_go=-1), message)

    def _finite(self, message: torch.Tensor) -> bool:
        assert self.flat is not None  # bound
        return all_finite(message[: self.flat.num_params] if message.dtype != torch.float32 else message)

    def _part(self, message: torch.Tensor, link: Link) -> torch.Tensor:
        """The link's values of the message: all of it (one PS process), or values start..end
        as the link sends them (`Link.own`)."""
        if len(self.links) == 1:
            return message
        if message.dtype != torch.float32:  # --compress (app.worker.compress.Compressor)
            assert self.flat is not None  # bound
            part = Compressor.slice(message, self.flat.num_params, link.start, link.end)
        else:
            part = message[link.start : link.end]
        return link.own(part)

    def _send(self, link: Link, part: torch.Tensor, push: Push, sealed: Sealed = NOTHING_SEALED) -> Any:
        """The RPC future of `push` to `link`."""
        try:
            return link.send(part, push, sealed, self.push_timeout)
        except RuntimeError as error:
            raise self.lost(link.name, calls.rpc_push, error) from error

    def send_rest(self, rest: list[Slice], push: Push, staleness: int) -> list[tuple[Link, Any]]:
        """A chained push's other slices, once the main PS answered with `staleness`."""
        return [
            (link, self._send(link, part, push._replace(pulled=pulled, staleness=staleness)))
            for link, part, pulled in rest
        ]

    def answer(self, link: Link, future: Any) -> Reply | Refusal:
        """The answer of `link` to a push: a Reply whose state is where it arrived."""
        try:
            answer = link.answer(future)
        except RuntimeError as error:
            raise self.lost(link.name, calls.rpc_push, error) from error
        return refused(answer)

    # The rest of a worker's calls.

    def finish(self, pushes: int) -> None:
        """The other shards first: once the main PS hears the last finish, it ends them."""
        for link in self.links[1:]:
            refused(self._call(link.name, calls.rpc_finish, self.rank, pushes, self.name))
        refused(self._call(PS, calls.rpc_finish, self.rank, pushes, self.name))

    def leave(self, pushes: int) -> None:
        """Leave the job for good (scaled down): the other shards first, then the main PS (which
        records it); the PS stops waiting for this rank."""
        for link in self.links[1:]:
            refused(self._call(link.name, calls.rpc_leave, self.rank, pushes, self.name))
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
    """A push on the wire to each link; holds its message until the replies came (RPC sends from
    it). `wait` gives one Reply for the whole vector (staleness and lead: the main PS's); `rest`:
    the slices still to send once the main PS answered, with its staleness (chained), as `push`
    says."""

    def __init__(
        self,
        channel: PSChannel,
        futures: list[tuple[Link, Any]],
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
        replies = [first] + [self.channel.answer(link, future) for link, future in self.futures[1:] + sent]
        done = []
        for reply in replies:
            if isinstance(reply, Refusal):
                return reply
            done.append(reply)
        vector = torch.cat([r.vector for r in done])
        versions = tuple(v for r in done for v in (r.version if isinstance(r.version, tuple) else (r.version,)))
        return Reply(vector, versions, first.staleness, first.lead)
