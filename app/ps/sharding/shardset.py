"""The main PS's side of a sharded PS (app.ps.sharding.slices): the other shards' registration,
readiness, pings, drops forwarded, checkpoints, the gathered state and the end."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from app.config import Config
from app.exchange import calls, transport
from app.exchange.group import READY_KEY
from app.exchange.wire import Joined, NotReady, Taken
from app.ps import rpc as endpoints
from app.ps.members.liveness import Pinger
from app.ps.sharding.slices import bounds
from app.runtime.words import first_line

log = logging.getLogger("app.ps")
PING_SECONDS = 1.0


class ShardSet:
    """On the main PS: the other shards, by index; readiness, gather, drops, end."""

    def __init__(
        self,
        k: int,
        size: int,
        config: Config,
        record: Callable[..., None],
        on_ready: Callable[[], None] = lambda: None,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_ready`: called each time every shard is up (again): workers can join from then on;
        `on_lost`: each time a shard is lost: no worker can join until `on_ready`."""
        self.k, self.size, self.timeout, self.record = k, size, config.rpc_timeout, record
        self.on_ready, self.on_lost = on_ready, on_lost
        self.config = config
        self._store: Any = None  # this process's own store, as workers see it
        self.bounds = bounds(size, k)
        self.names: dict[int, str] = {}
        self._lock = threading.Lock()
        self._pinger = Pinger(self.timeout)
        self._last_tick = 0.0
        self._warned = False

    def register(self, index: int, name: str, k: int, part: tuple[int, int]) -> str | None:
        """Shard `index` serves as `name`; an error line when it is not one of this job's."""
        if k != self.k or not 1 <= index < self.k or tuple(part) != self.bounds[index]:
            return (
                f"{name} (--shard {index} of --shards {k}, values {tuple(part)}) does not match the main "
                f"parameter server (--shards {self.k}, shard {index}: values "
                f"{self.bounds[index] if 1 <= index < self.k else 'none'})"
            )
        with self._lock:
            old = self.names.get(index)
            self.names[index] = name
            ready = self.ready
        log.info(
            "shard %d (%s) registered, values %d..%d%s%s",
            index,
            name,
            *part,
            f", replacing {old}" if old and old != name else "",
            f"; all {self.k} shards are up" if ready else "",
        )
        self.record("shard", 0, shard=index, name=name)
        if ready:
            self._ready_key(True)
            self.on_ready()
        return None

    def _ready_key(self, ready: bool) -> None:
        """READY_KEY in the job's store."""
        if self._store is None:
            self._store = transport.own_store(self.config, self.timeout)
        if ready:
            self._store.set(READY_KEY, "1")
        else:
            self._store.delete_key(READY_KEY)

    @property
    def ready(self) -> bool:
        return len(self.names) == self.k - 1

    def join(self, admit: Callable[[int, str], Joined | Taken], rank: int, name: str) -> Joined | Taken | NotReady:
        """A worker's join (app.ps.members.liveness.LivenessMonitor.join), once every shard is up;
        with the shards' names."""
        with self._lock:
            listing = tuple((self.names[i], *self.bounds[i]) for i in sorted(self.names))
        if len(listing) < self.k - 1:
            return NotReady(f"the parameter server's shards are not all up ({len(listing)} of {self.k - 1})")
        answer = admit(rank, name)
        if isinstance(answer, Joined):
            return answer._replace(part=self.bounds[0], shards=listing)
        return answer

    def _shards(self) -> list[tuple[int, str]]:
        with self._lock:
            return sorted(self.names.items())

    def gather(self, own: torch.Tensor) -> torch.Tensor | None:
        """The full state vector: `own` slice and every other shard's; None (one warning) when
        a shard does not answer."""
        full = torch.empty(self.size)
        start, end = self.bounds[0]
        full[start:end] = own
        shards = self._shards()
        if len(shards) < self.k - 1:
            self._skip("not every shard is up")
            return None
        futures = [
            (i, name, transport.call_async(name, calls.rpc_pull, (0,), timeout=self.timeout)) for i, name in shards
        ]
        for i, name, future in futures:
            try:
                vector, _ = future.wait()
            except Exception as error:  # noqa: BLE001 - any failure: that shard is gone or stuck
                self._skip(f"{name} did not answer ({first_line(error)})")
                return None
            start, end = self.bounds[i]
            full[start:end] = vector
        self._warned = False
        return full

    def _skip(self, why: str) -> None:
        if not self._warned:
            log.warning("cannot gather the shards' values: %s; skipping this evaluation", why)
            self._warned = True
        return None

    def drop(self, rank: int, name: str) -> None:
        """Forward a worker's drop, so no shard waits for it (sync rounds, ssp leads)."""
        for _, shard in self._shards():
            try:
                future = transport.call_async(shard, endpoints.rpc_drop, (rank, name), timeout=self.timeout)
                future.add_done_callback(_ignore)
            except RuntimeError:
                pass

    def checkpoint(self, version: int) -> None:
        """Every other shard writes its checkpoint labelled `version` (the main PS's, about to
        be written); RuntimeError naming the first that could not."""
        for _, name in self._shards():
            try:
                error = transport.call(name, endpoints.rpc_checkpoint, (version,), timeout=self.timeout)
            except Exception as lost:  # noqa: BLE001
                error = first_line(lost)
            if error:
                raise RuntimeError(f"{name} did not write its checkpoint labelled {version}: {error}")
        if len(self._shards()) < self.k - 1:
            raise RuntimeError("not every shard is up")

    def end(self, finished: bool) -> None:
        """Training ended: every shard writes its last checkpoint and exits 0."""
        for _, name in self._shards():
            try:
                transport.call(name, endpoints.rpc_end, (finished,), timeout=self.timeout)
            except Exception as error:  # noqa: BLE001
                log.warning("could not tell %s that training ended: %s", name, first_line(error))

    def tick(self) -> None:
        """Ping every shard (once a second); a lost one leaves the store's list, and workers
        wait for its next process."""
        now = time.monotonic()
        if now - self._last_tick < PING_SECONDS:
            return
        self._last_tick = now
        for index, name in self._shards():
            self._pinger.ping(name, functools.partial(self._lost, index, name))

    def _lost(self, index: int, name: str, why: str) -> None:
        with self._lock:
            if self.names.get(index) != name:
                return
            del self.names[index]
        self.on_lost()
        log.warning("lost shard %d (%s): %s; workers wait for its next process", index, name, why)
        self.record("shard_lost", 0, shard=index, name=name, reason=why)
        try:
            self._ready_key(False)
        except Exception as error:  # noqa: BLE001
            log.warning("could not note %s's loss in the store: %s", name, first_line(error))


def _ignore(future: Any) -> None:
    try:
        future.wait()
    except Exception:  # noqa: BLE001 - best effort
        pass
