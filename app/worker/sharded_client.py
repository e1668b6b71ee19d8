"""A worker's client of a sharded PS (app.ps.sharding.slices): PSClient's interface over K PS processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc

from app.config import UsageError
from app.contract import PS
from app.exchange import calls, group
from app.exchange.group import READY_KEY
from app.exchange.wire import Joined, Push, Refusal, Refused, Reply, SlotReply, Start, Version, all_finite
from app.exchange.worker_end import SharedLink, attach
from app.runtime import first_line
from app.worker.client import PSClient, PSUnreachable, call_joining, refused
from app.worker.compress import Compressor

POLL_SECONDS = 0.1


def wait_until_ready(master_addr: str, master_port: int, timeout: float) -> None:
    """Before a worker joins the RPC group: until every shard has registered with the main PS
    (so the join makes this process known to every shard, and them to it)."""
    store = group.connect(master_addr, master_port, timeout)
    deadline = time.monotonic() + timeout
    while not store.check([READY_KEY]):
        if time.monotonic() > deadline:
            raise group.StoreUnreachable(
                f"the parameter server at {master_addr}:{master_port} did not get all its shards within {timeout:.0f} s"
            )
        time.sleep(POLL_SECONDS)


class ShardedClient:
    """PSClient's interface over K PS processes; a version is a tuple, one per shard.

    `chained` (--staleness_lr): a push goes to the main PS first; the other slices
    follow once its reply came, carrying the staleness the main PS computed, so
    every slice of a push is scaled alike. Otherwise every slice goes at once."""

    def __init__(self, main: PSClient, chained: bool = False) -> None:
        self.main, self.chained = main, chained
        self.rank, self.name = main.rank, main.name
        self.parts: list[tuple[str, int, int]] = []
        self.num_params = 0  # where a compressed message's float32 buffers start
        self.links: dict[str, SharedLink] = {}  # the shards whose shared memory this worker maps

    def join(self) -> Start:
        """Join every shard; the main PS's progress (the authority on it) with the whole vector
        and one version per shard."""
        answer = self.main.admitted()
        if answer.part is None:
            raise RuntimeError("the parameter server answered as one process; this worker was started with shards")
        self.parts = [(PS, *answer.part), *answer.shards]
        self.links = {PS: self.main.link} if self.main.link is not None else {}
        slices, versions = [answer.vector], [answer.version]
        for name, _, _ in self.parts[1:]:
            try:
                got = call_joining(name, calls.rpc_join, (self.rank, self.name), self.main.timeout)
            except RuntimeError as error:
                raise self.lost(name, calls.rpc_join, error) from error
            if not isinstance(got, Joined):
                raise UsageError(got.message)
            link = attach(got.exchange, self.rank, self.main.device, self.main.exchange, self.name, name)
            if link is not None:
                self.links[name] = link
            slices.append(got.vector)
            versions.append(got.version)
        return Start(torch.cat(slices), tuple(versions), answer.progress)

    def message_buffers(self) -> None:
        """Each shard takes its slice of the message: no one buffer holds a whole push."""
        return None

    def reply_buffers(self) -> list[torch.Tensor]:
        """A reply is the shards' slices put together: a new tensor each time."""
        return []

    def push(
        self,
        message: torch.Tensor,
        version: Version,
        epoch: int = 1,
        batch: int = 0,
        samples: int = 0,
        noted: None = None,
        placed: None = None,
    ) -> Reply | Refusal:
        """PSClient.push's interface: a sharded PS takes pushes whole (no notes, nothing placed)."""
        return self.push_async(message, version, epoch, batch, samples).wait()

    def push_async(
        self,
        message: torch.Tensor,
        version: Version,
        epoch: int = 1,
        batch: int = 0,
        samples: int = 0,
        noted: None = None,
        placed: None = None,
    ) -> ShardedPush | _Refused:
        """Send every slice (the main PS's only, when chained); a non-finite message is
        refused here, before any shard applies a slice of it."""
        if not all_finite(message[: self.num_params] if message.dtype != torch.float32 else message):
            why = f"{self.name} computed non-finite values (NaN or inf); the push was not sent"
            return _Refused(Refusal(Refused.NONFINITE, why))
        assert isinstance(version, tuple)  # one version per PS process
        sends = [
            (name, self._part(message, start, end), pulled) for (name, start, end), pulled in zip(self.parts, version)
        ]
        rest = sends[1:] if self.chained else []
        return ShardedPush(
            self,
            [self.send(*s, epoch, batch, samples) for s in sends[: len(sends) - len(rest)]],
            rest,
            (epoch, batch, samples),
        )

    def _part(self, message: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Values start..end of the message (a view): a shard reached through shared memory
        copies it into its slot, TensorPipe sends a contiguous copy (only its own bytes)."""
        if message.dtype != torch.float32:  # --compress (app.worker.compress.Compressor)
            return Compressor.slice(message, self.num_params, start, end)
        return message[start:end]

    def send(
        self,
        name: str,
        part: torch.Tensor,
        pulled: int,
        epoch: int,
        batch: int,
        samples: int,
        staleness: int | None = None,
    ) -> tuple[str, Any]:
        link = self.links.get(name)
        push = Push(self.rank, self.name, pulled, epoch, batch, samples, staleness)
        try:
            if link is not None:
                slot, dtype = link.place(part), str(part.dtype).removeprefix("torch.")
                args: tuple[Any, ...] = (slot, dtype, part.numel(), push)
                return name, rpc.rpc_async(name, calls.rpc_push_slot, args=args, timeout=self.main.push_timeout)
            args = (part.clone(), push)
            return name, rpc.rpc_async(name, calls.rpc_push, args=args, timeout=self.main.push_timeout)
        except RuntimeError as error:
            raise self.lost(name, calls.rpc_push, error) from error

    def finish(self, pushes: int) -> None:
        """The other shards first: once the main PS hears the last finish, it ends them."""
        for name, _, _ in self.parts[1:]:
            refused(self._call(name, calls.rpc_finish, self.rank, pushes, self.name))
        self.main.finish(pushes)

    def leave(self, pushes: int) -> None:
        """Scaled down: the other shards first, then the main PS (which records it)."""
        for name, _, _ in self.parts[1:]:
            refused(self._call(name, calls.rpc_leave, self.rank, pushes, self.name))
        self.main.leave(pushes)

    def shard(self) -> tuple[int, int]:
        return self.main.shard()

    def _call(self, name: str, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return rpc.rpc_sync(name, function, args=args, timeout=self.main.timeout)
        except RuntimeError as error:
            raise self.lost(name, function, error) from error

    def lost(self, name: str, function: Callable[..., Any], error: BaseException) -> Exception:
        if name == PS:
            return self.main.lost(function, error)
        return PSUnreachable(
            f"lost parameter server shard {name} (job at {self.main.address}) "
            f"during {function.__name__}: {first_line(error)}"
        )


class _Refused:
    """A push refused before it was sent; `wait` gives the Refusal."""

    def __init__(self, refusal: Refusal) -> None:
        self.refusal = refusal

    def wait(self) -> Refusal:
        return self.refusal


class ShardedPush:
    """A push on the wire to every shard; `wait` gives one Reply for the whole vector
    (staleness and lead: the main PS's). `rest`: the slices still to send once the
    main PS answered, with its staleness (ShardedClient.chained)."""

    def __init__(
        self,
        client: ShardedClient,
        futures: list[tuple[str, Any]],
        rest: list[tuple[str, torch.Tensor, int]] | None = None,
        progress: tuple[int, int, int] = (1, 0, 0),
    ) -> None:
        self.client, self.futures, self.rest, self.progress = client, futures, rest or [], progress

    def wait(self) -> Reply | Refusal:
        replies = [self._wait(*self.futures[0])]
        if isinstance(replies[0], Refusal):
            return replies[0]
        sent = [
            self.client.send(name, part, pulled, *self.progress, staleness=replies[0].staleness)
            for name, part, pulled in self.rest
        ]
        for name, future in self.futures[1:] + sent:
            replies.append(self._wait(name, future))
        done = []
        for reply in replies:
            if isinstance(refused(reply), Refusal):
                return reply
            assert isinstance(reply, Reply)
            done.append(reply)
        vector = torch.cat([r.vector for r in done])
        versions = tuple(v for r in done for v in (r.version if isinstance(r.version, tuple) else (r.version,)))
        return Reply(vector, versions, done[0].staleness, done[0].lead)

    def _wait(self, name: str, future: Any) -> Reply | Refusal:
        try:
            answer = future.wait()
        except RuntimeError as error:
            raise self.client.lost(name, calls.rpc_push, error) from error
        if isinstance(answer, SlotReply) and name in self.client.links:
            return self.client.links[name].reply(answer)
        return refused(answer)
