"""A worker's channel to its PS: the control calls (join, finish, leave, the next epoch's share)
and the route its steps take (app.exchange.route), chosen as it joins.

The trainer (app.worker.trainer) holds a `Channel` and nothing else of the PS: it joins through
it, and each step goes straight to its `route` (bind once; backward, seal, push, then wait for the
pending reply, whose state the wait makes the model's). `PSChannel` is the one kind there is: its
PS is one process or a sharded PS's K processes (app.ps.sharding.slices). Each process is reached
by the route `connect` chooses as it is joined: through its shared memory
(app.exchange.shared_route) where its answer offers a segment this worker can map, else over the
job's socket (app.exchange.socket_route). The route of one PS process is the channel's route; a
sharded PS's is one route over them all (app.worker.sharded). Nothing outside those modules asks
which route it has.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from app.config import Config, UsageError
from app.contract import PS, worker_name
from app.exchange import calls, group, transport
from app.exchange.group import READY_KEY
from app.exchange.route import ProcessRoute, PSUnreachable, Pusher, Route, refused, unreachable
from app.exchange.shared_route import attach
from app.exchange.socket_route import SocketRoute
from app.exchange.wire import Joined, NotReady, Share, Start, Taken
from app.worker.sharded import ShardedRoute

NOT_IN_GROUP_YET = "could not find destination name"
POLL_SECONDS = 0.1


class Channel(Protocol):
    """What the trainer asks of its PS (app.worker.trainer), whatever carries it: the control
    calls, and `route`, once joined, for each step."""

    name: str
    route: Route

    def join(self) -> Start: ...
    def finish(self, pushes: int) -> None: ...
    def leave(self, pushes: int) -> None: ...
    def share(self, finished: Share | None) -> Share | None: ...


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


class PSChannel:
    """The channel to one PS process or to a sharded PS's every process; every call bounded by
    rpc_timeout (a push under ssp or sync may also wait `push_wait` for the slowest worker).
    `exchange`: auto (shared memory where a PS process offers it and this process can map it)
    or transport. `sharded`: the worker was started for a sharded PS (--shards K > 1);
    `chained`: --staleness_lr (app.worker.sharded)."""

    route: Route  # once joined

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
        device = device or torch.device("cpu")
        self.pusher = Pusher(rank, self.name, address, timeout + push_wait, device, overlap)
        self.exchange, self.sharded, self.chained = exchange, sharded, chained
        self.others: list[str] = []  # a sharded PS's other processes, by name

    def join(self) -> Start:
        """The state to start from and this rank's progress (the main PS is the authority on
        it); UsageError if the rank is taken, PSUnreachable if the PS cannot be reached or its
        shards are not all up. Each PS process's route is chosen as it is joined."""
        joined = self._join(PS)
        if isinstance(joined, Taken):
            raise UsageError(joined.message)
        if isinstance(joined, NotReady):  # a shard restarts: start again once it is back
            raise self.lost(PS, calls.rpc_join, RuntimeError(joined.message))
        if self.sharded and joined.part is None:
            raise RuntimeError("the parameter server answered as one process; this worker was started with shards")
        start, end = joined.part or (0, joined.vector.numel())
        routes = [self.connect(joined, PS, start, end)]
        slices, versions = [joined.vector], [joined.version]
        for name, start, end in joined.shards:
            got = self._join(name)
            if not isinstance(got, Joined):
                raise UsageError(got.message)
            routes.append(self.connect(got, name, start, end))
            slices.append(got.vector)
            versions.append(got.version)
        self.others = [route.name for route in routes[1:]]
        self.route = self.routed(routes)
        if len(routes) == 1:
            return Start(joined.vector, joined.version, joined.progress)
        return Start(torch.cat(slices), tuple(versions), joined.progress)

    def _join(self, name: str) -> Joined | Taken | NotReady:
        try:
            return call_joining(name, calls.rpc_join, (self.rank, self.name), self.timeout)
        except RuntimeError as error:
            raise self.lost(name, calls.rpc_join, error) from error

    def connect(self, joined: Joined, name: str, start: int, end: int) -> ProcessRoute:
        """The route to PS process `name` (serving values start..end), chosen once as it joined:
        its shared memory where its answer offers a segment this worker can map (--exchange
        auto), else the job's socket."""
        shared = attach(joined.exchange, self.pusher, self.exchange, name, start, end)
        return shared if shared is not None else SocketRoute(self.pusher, name, start, end)

    def routed(self, routes: list[ProcessRoute]) -> Route:
        """The route of a whole push: the one PS process's, or one over a sharded PS's every
        process (the main PS's first)."""
        return routes[0] if len(routes) == 1 else ShardedRoute(self.pusher, routes, self.chained)

    def finish(self, pushes: int) -> None:
        """The other shards first: once the main PS hears the last finish, it ends them."""
        for name in [*self.others, PS]:
            refused(self._call(name, calls.rpc_finish, self.rank, pushes, self.name))

    def leave(self, pushes: int) -> None:
        """Leave the job for good (scaled down): the other shards first, then the main PS (which
        records it); the PS stops waiting for this rank."""
        for name in [*self.others, PS]:
            refused(self._call(name, calls.rpc_leave, self.rank, pushes, self.name))

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
        return unreachable(self.address, name, function, error)
