"""A parameter server sharded across K processes (`--shards K`): no process carries every byte.

The state vector [params | float buffers] (app.flat) is cut into K contiguous,
balanced slices (`bounds`). SGD with momentum is elementwise, so each shard
applies to its slice exactly the update one PS would; buffers slice the same
way. Every shard runs the same `ParameterServer` (`part=bounds[i]`) and
strategy, and sees every worker's push of its slice.

- Shard 0 is the main PS (`ps`, at master_addr): it starts the RPC group, holds
  the store, admits and pings workers, evaluates and writes final.pt. It waits
  for the K-1 other shards before it admits a worker (`ShardSet.join` answers
  `wait`; workers wait for READY_KEY in the store before they even join the
  RPC group, so they learn every shard's name), answers a join with the
  shards' names and bounds, forwards worker drops to them, gathers their
  slices to evaluate and for final.pt, and tells them when training ended.
- Shard I>0 (`python -m app ps --shard I`, `serve_shard`) claims `ps<I>`
  (`ps<I>_r2`, ... after a restart) through the store, joins the group (it
  stays on the store's member list, so every later joiner learns it),
  registers with the main PS, serves its slice, checkpoints it under
  `<checkpoint_dir>/shard<I>/`, exits 0 when told training ended and 1 when
  it loses the main PS.
- Checkpoints are driven by the main PS: before it writes its own at version
  V, every other shard writes its slice labelled V (`rpc_checkpoint`); if one
  cannot, the main PS writes none. The main PS's newest checkpoint therefore
  has a partner labelled V in every shard's directory, and a (re)starting
  shard asks the main PS which V it resumed from (`rpc_resumed`) and restores
  its checkpoint labelled V (`checkpoint_labelled`), never a newer one of its
  own. A shard restarted while the main PS runs on restores the main PS's
  last checkpoint label too: its slice is then older than the others' until
  training moves on (the price of not stopping the whole job).
- What is identical to one PS: every shard applies the same SGD elementwise,
  so the assembled vector equals one PS's bit for bit whenever every shard
  applied the same pushes in the same order: always for sync (a round's
  gradients are averaged in rank order), and for async/ssp when pushes do not
  overlap in time. RPC does not order overlapping pushes across shards, so
  then slices may apply them in different orders (with momentum, different
  bits). A push's staleness is the main PS's, for every slice: with
  --staleness_lr a worker sends the other slices once the main PS answered,
  with its staleness (`ShardedClient.chained`); the reply's staleness and lead
  are the main PS's.
- A worker (`ShardedClient`) joins every shard, pushes each its slice (a
  contiguous copy: TensorPipe sends a view's whole storage when the view is
  more than half of it) in parallel and assembles the replies with one copy.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from app import checkpoint, data, membership, models, plugins, ps
from app.config import Config, UsageError
from app.flat import _float_buffers
from app.metrics import MetricsWriter
from app.runtime import first_line

log = logging.getLogger("app.ps")
MAIN = "ps"
READY_KEY = "psc/shards_ready"
PING_SECONDS = 1.0
TICK_SECONDS = 0.25
POLL_SECONDS = 0.1


def bounds(size: int, k: int) -> list[tuple[int, int]]:
    """K contiguous slices of range(size), lengths differing by at most one."""
    if k < 1:
        raise ValueError(f"{k} shards: must be at least 1")
    step, extra = divmod(size, k)
    out, start = [], 0
    for i in range(k):
        end = start + step + (i < extra)
        out.append((start, end))
        start = end
    return out


def state_size(model: nn.Module) -> int:
    """Values in the model's state vector (app.flat): parameters and float buffers."""
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for _, _, b in _float_buffers(model))


class MainPSLost(RuntimeError):
    """A shard lost the main PS (it died, or did not answer within rpc_timeout)."""


# --- the main PS's side ----------------------------------------------------------

class ShardSet:
    """On the main PS: the other shards, by index; readiness, gather, drops, end."""

    def __init__(self, k: int, size: int, config: Config, record: Callable[..., None]) -> None:
        self.k, self.size, self.timeout, self.record = k, size, config.rpc_timeout, record
        self.address = (config.master_addr, config.master_port)
        self._store: Any = None  # a client of this process's own store, as workers see it
        self.bounds = bounds(size, k)
        self.names: dict[int, str] = {}
        self._lock = threading.Lock()
        self._pinging: set[str] = set()
        self._last_tick = 0.0
        self._warned = False

    def register(self, index: int, name: str, k: int, part: tuple[int, int]) -> str | None:
        """Shard `index` serves as `name`; an error line when it is not one of this job's."""
        if k != self.k or not 1 <= index < self.k or tuple(part) != self.bounds[index]:
            return (f"{name} (--shard {index} of --shards {k}, values {tuple(part)}) does not match the main "
                    f"parameter server (--shards {self.k}, shard {index}: values "
                    f"{self.bounds[index] if 1 <= index < self.k else 'none'})")
        with self._lock:
            old = self.names.get(index)
            self.names[index] = name
            ready = self.ready
        log.info("shard %d (%s) registered, values %d..%d%s%s", index, name, *part,
                 f", replacing {old}" if old and old != name else "",
                 f"; all {self.k} shards are up" if ready else "")
        self.record("shard", 0, shard=index, name=name)
        if ready:
            self._ready_key(True)
        return None

    def _ready_key(self, ready: bool) -> None:
        """READY_KEY in the store (RPC's own keys carry a prefix, so through a plain client)."""
        if self._store is None:
            self._store = membership.connect(*self.address, self.timeout)
        if ready:
            self._store.set(READY_KEY, "1")
        else:
            self._store.delete_key(READY_KEY)

    @property
    def ready(self) -> bool:
        return len(self.names) == self.k - 1

    def join(self, admit: Callable[[int, str], dict[str, Any]], rank: int, name: str) -> dict[str, Any]:
        """A worker's join (app.liveness.Watch.join), once every shard is up; with the shards' names."""
        with self._lock:
            listing = [(self.names[i], *self.bounds[i]) for i in sorted(self.names)]
        if len(listing) < self.k - 1:
            return {"wait": f"the parameter server's shards are not all up ({len(listing)} of {self.k - 1})"}
        answer = admit(rank, name)
        if "taken" not in answer:
            answer.update(part=self.bounds[0], shards=listing)
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
            return self._skip("not every shard is up")
        futures = [(i, name, rpc.rpc_async(name, ps.rpc_pull, args=(0,), timeout=self.timeout))
                   for i, name in shards]
        for i, name, future in futures:
            try:
                vector, _ = future.wait()
            except Exception as error:  # noqa: BLE001 - any failure: that shard is gone or stuck
                return self._skip(f"{name} did not answer ({first_line(error)})")
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
                future = rpc.rpc_async(shard, rpc_drop, args=(rank, name), timeout=self.timeout)
                future.add_done_callback(_ignore)
            except RuntimeError:
                pass

    def checkpoint(self, version: int) -> None:
        """Every other shard writes its checkpoint labelled `version` (the main PS's, about to
        be written); RuntimeError naming the first that could not."""
        for _, name in self._shards():
            try:
                error = rpc.rpc_sync(name, rpc_checkpoint, args=(version,), timeout=self.timeout)
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
                rpc.rpc_sync(name, rpc_end, args=(finished,), timeout=self.timeout)
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
            with self._lock:
                if name in self._pinging:
                    continue
                self._pinging.add(name)
            future = rpc.rpc_async(name, membership.pong, timeout=self.timeout)
            future.add_done_callback(lambda f, i=index, n=name: self._pinged(i, n, f))

    def _pinged(self, index: int, name: str, future: Any) -> None:
        try:
            future.wait()
        except Exception as error:  # noqa: BLE001
            self._lost(index, name, first_line(error))
        finally:
            with self._lock:
                self._pinging.discard(name)

    def _lost(self, index: int, name: str, why: str) -> None:
        with self._lock:
            if self.names.get(index) != name:
                return
            del self.names[index]
        log.warning("lost shard %d (%s): %s; workers wait for its next process", index, name, why)
        self.record("shard_lost", 0, shard=index, name=name, reason=why)
        try:
            self._ready_key(False)
            membership.unlist([name], self.timeout)
        except Exception as error:  # noqa: BLE001
            log.warning("could not take %s off the store's member list: %s", name, first_line(error))


class _Main:
    """Where `rpc_register` finds the main PS's ShardSet (set while it serves), and the
    version of the checkpoint the main PS resumed from (None: a new run)."""

    shards: ShardSet | None = None
    resumed: int | None = None


@contextmanager
def main_serving(shards: ShardSet | None, resumed: int | None = None) -> Iterator[None]:
    _Main.shards, _Main.resumed = shards, resumed
    try:
        yield
    finally:
        _Main.shards, _Main.resumed = None, None


def rpc_resumed() -> int | None:
    """The version of the main PS's checkpoint every shard resumes from (None: a new run)."""
    return _Main.resumed


def rpc_register(index: int, name: str, k: int, part: tuple[int, int]) -> str | None:
    """A shard announces itself to the main PS; an error line, or None."""
    if _Main.shards is None:
        return "the main parameter server runs with --shards 1"
    return _Main.shards.register(index, name, k, part)


# --- a shard's side --------------------------------------------------------------

class _Ended:
    event = threading.Event()
    finished = False


class _Shard:
    """Where `rpc_checkpoint` finds this shard's checkpoint writer (set while it serves)."""

    save: Callable[[int], str | None] | None = None


def rpc_checkpoint(version: int) -> str | None:
    """Write this shard's checkpoint labelled `version`; an error line, or None."""
    if _Shard.save is None:
        return "this shard is not serving yet"
    return _Shard.save(version)


def checkpoint_labelled(directory: str | Path, version: int) -> tuple[Path, dict[str, Any]] | None:
    """The newest good checkpoint in `directory` labelled `version` by the main PS."""
    for path in checkpoint.listing(directory):
        try:
            state = checkpoint.verify(path)
        except (ValueError, OSError) as error:
            log.warning("skipping checkpoint %s: %s", path, error)
            continue
        if state.get("label") == version:
            return path, state
    return None


def resume_shard(server: ps.ParameterServer, directory: str | Path, version: int | None) -> str:
    """Restore the shard's checkpoint labelled `version` (the main PS's); what was done, for the log.
    RuntimeError (exit 1) when this shard has none labelled so."""
    if version is None:
        return "the main parameter server starts a new run: starting from the initial values"
    found = checkpoint_labelled(directory, version)
    if found is None:
        raise RuntimeError(f"no checkpoint labelled {version} in {directory}: cannot resume with the "
                           "main parameter server's checkpoint at that version")
    path, state = found
    server.restore(state)
    return f"resumed from {path.name} (the main parameter server's version {version})"


def rpc_drop(rank: int, name: str) -> bool:
    return ps._ENDPOINT.get().drop(rank, name)


def rpc_end(finished: bool) -> None:
    _Ended.finished = finished
    _Ended.event.set()


def serve_shard(config: Config) -> int:
    """Shard `config.shard` of `config.shards`: serve its slice until the main PS says the end."""
    from app.serve import Checkpointer  # serve imports this module

    index, k = config.shard, config.shards
    models.check(config.model)
    held_out = data.load(config.dataset, config.data_dir, "test", config.seed, config.image_size)
    model = models.build(config.model, held_out.channels, held_out.num_classes, config.seed)
    if config.init_weights:  # this shard's slice starts from the same weights as the main PS's
        plugins.load_weights(model, config.init_weights)
    part = bounds(state_size(model), k)[index]
    server = ps.ParameterServer(model, config.lr, config.momentum, config.num_trainers, config.join_timeout,
                                strategy=config.strategy, staleness=config.staleness,
                                staleness_lr=config.staleness_lr, part=part)
    log.info("shard %d of %d: values %d..%d of %d (%d parameter values)", index, k, *part,
             server.flat.size, server.num_params)
    identity = dict(model_name=config.model, dataset=config.dataset, channels=held_out.channels,
                    num_classes=held_out.num_classes, world_size=config.world_size, shards=k, shard=index)
    own = dataclasses.replace(config, checkpoint_dir=str(Path(config.checkpoint_dir) / f"shard{index}"))
    address = f"{config.master_addr}:{config.master_port}"
    _Ended.event.clear()
    own = dataclasses.replace(own, checkpoint_every=0)  # the main PS says when (rpc_checkpoint)
    with MetricsWriter(config.metrics_dir, config.name, "ps", 0) as metrics:
        checkpoints = Checkpointer(server, own, identity, metrics)
        Path(own.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        checkpoint.remove_temp_files(own.checkpoint_dir)
        name, rpc_id = membership.claim_shard_identity(index, config.master_addr, config.master_port,
                                                       config.rpc_timeout)
        from app.runtime import rpc_session
        with ps._ENDPOINT.serving(server), rpc_session(config, rank=rpc_id, name=name):
            try:
                resumed = rpc.rpc_sync(MAIN, rpc_resumed, timeout=config.rpc_timeout)
            except RuntimeError as lost:
                raise MainPSLost(f"lost the main parameter server at {address}: {first_line(lost)}") from None
            log.info("%s: %s", name, resume_shard(server, own.checkpoint_dir, resumed))
            _Shard.save = functools.partial(_save_labelled, server, identity, own.checkpoint_dir)
            try:
                error = rpc.rpc_sync(MAIN, rpc_register, args=(index, name, k, part), timeout=config.rpc_timeout)
            except RuntimeError as lost:
                raise MainPSLost(f"lost the main parameter server at {address}: {first_line(lost)}") from None
            if error:
                raise UsageError(error)
            try:
                _serve_until_ended(server, checkpoints, config, address)
            finally:
                _Shard.save = None
            state = {**server.checkpoint(), **identity, "finished": _Ended.finished}
            path = checkpoint.save(state, own.checkpoint_dir)
            log.info("%s: training ended; last checkpoint %s (version %d)", name, path.name, state["version"])
        metrics.write("end", server.version, **server.stats())
    return 0


def _serve_until_ended(server: ps.ParameterServer, checkpoints: Any, config: Config, address: str) -> None:
    last_ping = time.monotonic()
    while not _Ended.event.is_set():
        server.wait(checkpoints.next_version or server.version + (1 << 62), timeout=TICK_SECONDS)
        server.unblock()
        if time.monotonic() - last_ping >= PING_SECONDS and not _Ended.event.is_set():
            try:
                rpc.rpc_sync(MAIN, membership.pong, timeout=config.rpc_timeout)
            except RuntimeError as error:
                if _Ended.event.is_set():
                    return
                raise MainPSLost(f"lost the main parameter server at {address}: {first_line(error)}") from None
            last_ping = time.monotonic()


def _save_labelled(server: ps.ParameterServer, identity: dict[str, Any], directory: str, version: int) -> str | None:
    """This shard's checkpoint, labelled with the main PS's `version`; an error line, or None."""
    try:
        path = checkpoint.save({**server.checkpoint(), **identity, "label": version}, directory)
    except OSError as error:
        log.warning("checkpoint labelled %d not written: %s", version, error)
        return first_line(error)
    log.info("checkpoint %s (labelled %d by the main parameter server)", path.name, version)
    return None


# --- a worker's side -------------------------------------------------------------

def wait_until_ready(master_addr: str, master_port: int, timeout: float) -> None:
    """Before a worker joins the RPC group: until every shard has registered with the main PS
    (so the join makes this process known to every shard, and them to it)."""
    store = membership.connect(master_addr, master_port, timeout)
    deadline = time.monotonic() + timeout
    while not store.check([READY_KEY]):
        if time.monotonic() > deadline:
            raise membership.StoreUnreachable(
                f"the parameter server at {master_addr}:{master_port} did not get all its shards "
                f"within {timeout:.0f} s")
        time.sleep(POLL_SECONDS)


class ShardedClient:
    """PSClient's interface over K PS processes; a version is a tuple, one per shard.

    `chained` (--staleness_lr): a push goes to the main PS first; the other slices
    follow once its reply came, carrying the staleness the main PS computed, so
    every slice of a push is scaled alike. Otherwise every slice goes at once."""

    def __init__(self, main: Any, chained: bool = False) -> None:  # an app.worker.PSClient
        self.main, self.chained = main, chained
        self.rank, self.name = main.rank, main.name
        self.parts: list[tuple[str, int, int]] = []
        self.num_params = 0  # where a compressed message's float32 buffers start

    def join(self) -> dict[str, Any]:
        """Join every shard; the main PS's answer (the authority on progress) with the whole
        vector and one version per shard."""
        answer = self.main.join()
        if "wait" in answer:  # a shard restarts: start again once it is back
            raise self.main._lost(ps.rpc_join, RuntimeError(answer["wait"]))
        self.parts = [(MAIN, *answer["part"])] + [tuple(s) for s in answer["shards"]]
        slices, versions = [answer["vector"]], [answer["version"]]
        for name, _, _ in self.parts[1:]:
            got = self._call(name, ps.rpc_join, self.rank, self.name)
            if "taken" in got:
                raise UsageError(got["taken"])
            slices.append(got["vector"])
            versions.append(got["version"])
        return {**answer, "vector": torch.cat(slices), "version": tuple(versions)}

    def push(self, message: torch.Tensor, version: tuple[int, ...], epoch: int = 1, batch: int = 0,
             samples: int = 0) -> ps.Reply:
        return self.push_async(message, version, epoch, batch, samples).wait()

    def push_async(self, message: torch.Tensor, version: tuple[int, ...], epoch: int = 1, batch: int = 0,
                   samples: int = 0) -> "ShardedPush | ps.Refusal":
        """Send every slice (the main PS's only, when chained); a non-finite message is
        refused here, before any shard applies a slice of it."""
        if not bool(torch.isfinite(message[:self.num_params] if message.dtype != torch.float32
                                   else message).all()):
            return _Refused(ps.Refusal("nonfinite", f"{self.name} computed non-finite values (NaN or inf); "
                                       "the push was not sent"))
        sends = [(name, self._part(message, start, end), pulled)
                 for (name, start, end), pulled in zip(self.parts, version)]
        rest = sends[1:] if self.chained else []
        return ShardedPush(self, [self._send(*s, epoch, batch, samples) for s in sends[:len(sends) - len(rest)]],
                           rest, (epoch, batch, samples))

    def _part(self, message: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Values start..end of the message, contiguous: only its own bytes go on the wire."""
        if message.dtype != torch.float32:  # --compress (app.worker.Compressor)
            from app.worker import Compressor
            return Compressor.slice(message, self.num_params, start, end).clone()
        return message[start:end].clone()

    def _send(self, name: str, part: torch.Tensor, pulled: int, epoch: int, batch: int, samples: int,
              staleness: int | None = None) -> tuple[str, Any]:
        args = (self.rank, part, pulled, self.name, epoch, batch, samples, staleness)
        try:
            return name, rpc.rpc_async(name, ps.rpc_push, args=args, timeout=self.main.push_timeout)
        except RuntimeError as error:
            raise self._lost(name, ps.rpc_push, error) from error

    def finish(self, pushes: int) -> None:
        """The other shards first: once the main PS hears the last finish, it ends them."""
        from app.worker import refused
        for name, _, _ in self.parts[1:]:
            refused(self._call(name, ps.rpc_finish, self.rank, pushes, self.name))
        self.main.finish(pushes)

    def _call(self, name: str, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return rpc.rpc_sync(name, function, args=args, timeout=self.main.timeout)
        except RuntimeError as error:
            raise self._lost(name, function, error) from error

    def _lost(self, name: str, function: Callable[..., Any], error: BaseException) -> Exception:
        if name == MAIN:
            return self.main._lost(function, error)
        from app.worker import PSUnreachable
        return PSUnreachable(f"lost parameter server shard {name} (job at {self.main.address}) "
                             f"during {function.__name__}: {first_line(error)}")


class _Refused:
    """A push refused before it was sent; `wait` gives the Refusal."""

    def __init__(self, refusal: ps.Refusal) -> None:
        self.refusal = refusal

    def wait(self) -> ps.Refusal:
        return self.refusal


class ShardedPush:
    """A push on the wire to every shard; `wait` gives one Reply for the whole vector
    (staleness and lead: the main PS's). `rest`: the slices still to send once the
    main PS answered, with its staleness (ShardedClient.chained)."""

    def __init__(self, client: ShardedClient, futures: list[tuple[str, Any]],
                 rest: list[tuple[str, torch.Tensor, int]] | None = None,
                 progress: tuple[int, int, int] = (1, 0, 0)) -> None:
        self.client, self.futures, self.rest, self.progress = client, futures, rest or [], progress

    def wait(self) -> ps.Reply | ps.Refusal:
        from app.worker import refused
        replies = [self._wait(*self.futures[0])]
        if isinstance(replies[0], ps.Refusal):
            return replies[0]
        sent = [self.client._send(name, part, pulled, *self.progress, staleness=replies[0].staleness)
                for name, part, pulled in self.rest]
        for name, future in self.futures[1:] + sent:
            replies.append(self._wait(name, future))
        for reply in replies:
            if isinstance(refused(reply), ps.Refusal):
                return reply
        vector = torch.cat([r.vector for r in replies])
        return ps.Reply(vector, tuple(r.version for r in replies), replies[0].staleness, replies[0].lead)

    def _wait(self, name: str, future: Any) -> ps.Reply | ps.Refusal:
        from app.worker import refused
        try:
            return refused(future.wait())
        except RuntimeError as error:
            raise self.client._lost(name, ps.rpc_push, error) from error


def _ignore(future: Any) -> None:
    try:
        future.wait()
    except Exception:  # noqa: BLE001 - best effort
        pass


