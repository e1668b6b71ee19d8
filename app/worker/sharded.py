"""A worker's route to a sharded PS (app.ps.sharding.slices): one route (app.exchange.route)
over the route to each of its K processes, each serving a slice of the state vector.

The whole push is carried as RPC carries it (app.exchange.socket_route.Carried: no one shard's
route holds a whole message); each shard's route is sent its slice. A non-finite message is
refused here, before any shard applies a slice of it; with `chained` (--staleness_lr) the main
PS's slice goes first and the others follow once it answered, with its staleness, so every slice
of a push is scaled alike; otherwise every slice goes at once. The reply is the slices put
together (one copy), its version a tuple, its staleness and lead the main PS's; waiting for it
makes it the model's state, as for one PS process.
"""

from __future__ import annotations

from typing import Any

import torch

from app.exchange.route import Answered, Outgoing, Pending, ProcessRoute, Pusher
from app.exchange.socket_route import Carried
from app.exchange.wire import Push, Refusal, Refused, Reply, Version, all_finite
from app.worker.compress import Compressor

# a shard's route, its part of a message, the version of its state pulled
Slice = tuple[ProcessRoute, torch.Tensor, int]


class ShardedRoute(Carried):
    """The route to a sharded PS: `shards` in order, the main PS's first."""

    def __init__(self, pusher: Pusher, shards: list[ProcessRoute], chained: bool = False) -> None:
        super().__init__(pusher)
        self.shards, self.chained = shards, chained

    def go(self, outgoing: Outgoing, version: Version, push: Push) -> Pending:
        """Each shard's slice (the main PS's only first, when chained); a push that holds NaN or
        inf is refused here."""
        message = outgoing.message
        if not (push.finite or self._finite(message)):
            why = f"{self.pusher.name} computed non-finite values (NaN or inf); the push was not sent"
            return Answered(Refusal(Refused.NONFINITE, why))
        push = push._replace(finite=True)  # checked here, for every shard's slice
        versions = version if isinstance(version, tuple) else (version,)
        sends = [(shard, self._part(message, shard), pulled) for shard, pulled in zip(self.shards, versions)]
        rest = sends[1:] if self.chained else []
        now = sends[: len(sends) - len(rest)]
        futures = [(shard, shard.send(Outgoing(part), push._replace(pulled=pulled))) for shard, part, pulled in now]
        return ShardedPending(self, futures, rest, push._replace(to_go=-1, loss=None, samples_per_s=None), message)

    def _finite(self, message: torch.Tensor) -> bool:
        assert self.flat is not None  # bound
        return all_finite(message[: self.flat.num_params] if message.dtype != torch.float32 else message)

    def _part(self, message: torch.Tensor, shard: ProcessRoute) -> torch.Tensor:
        """The shard's values of the message, start..end, as its route sends them (`own`)."""
        if message.dtype != torch.float32:  # --compress (app.worker.compress.Compressor)
            assert self.flat is not None  # bound
            part = Compressor.slice(message, self.flat.num_params, shard.start, shard.end)
        else:
            part = message[shard.start : shard.end]
        return shard.own(part)

    def send_rest(self, rest: list[Slice], push: Push, staleness: int) -> list[tuple[ProcessRoute, Any]]:
        """A chained push's other slices, once the main PS answered with `staleness`."""
        return [
            (shard, shard.send(Outgoing(part), push._replace(pulled=pulled, staleness=staleness)))
            for shard, part, pulled in rest
        ]


class ShardedPending:
    """A push on the wire to each shard; holds its message until the replies came (RPC sends from
    it). `wait` gives one Reply for the whole vector (staleness and lead: the main PS's), the
    model's state from then on; `rest`: the slices still to send once the main PS answered, with
    its staleness (chained), as `push` says."""

    def __init__(
        self,
        route: ShardedRoute,
        futures: list[tuple[ProcessRoute, Any]],
        rest: list[Slice],
        push: Push,
        message: torch.Tensor,
    ) -> None:
        self.route, self.futures, self.rest, self.push, self.message = route, futures, rest, push, message

    def wait(self) -> Reply | Refusal:
        shard, future = self.futures[0]
        first = shard.answer(future)
        if isinstance(first, Refusal):
            return first
        sent = self.route.send_rest(self.rest, self.push, first.staleness) if self.rest else []
        replies = [first] + [shard.answer(future) for shard, future in self.futures[1:] + sent]
        done = []
        for reply in replies:
            if isinstance(reply, Refusal):
                return reply
            done.append(reply)
        vector = torch.cat([r.vector for r in done])
        versions = tuple(v for r in done for v in (r.version if isinstance(r.version, tuple) else (r.version,)))
        whole = Reply(vector, versions, first.staleness, first.lead)
        self.route.load(whole)
        return whole
