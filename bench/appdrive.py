"""The app's own PS and worker code paths, driven by the bench.

What is the app's: the PS's update (`app.ps.server.ParameterServer` behind the
`app.exchange.calls.rpc_*` calls the workers make), the worker's step
(`app.worker.trainer.Trainer.compute_gradients` and `push_and_pull` through
`app.worker.channels.PSChannel`'s route), the flat buffers (`app.training.flat`), the transport
(`app.exchange.transport`: each process is in the job while its `session` lasts) and thread
count (`app.runtime.machine.set_threads`). The case's processes talk over UNIX sockets in the
case's directory (`socket_dir`, PLAIN), proving the case's secret (`secret_file`), both made by
bench.procs: what `make local` gives a run (orchestrator.job_secret).

What is the bench's: the model (bench.models), a fixed synthetic batch, and the lifecycle of
the job (a fixed set of processes; a worker tells every PS process it is done, and each PS
process leaves once every worker has left), so that changes to the app's membership and
failure handling do not change what is measured. Every use of the app's interfaces is in
this file: when they change, this file is adapted. `--app-path` measures another copy of the
app through the same interfaces: an app from before the job's own transport (torch RPC) is
not supported.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.futures import Future

from app.exchange import transport
from bench import loop
from bench.models import SPECS

RPC_TIMEOUT = 120
POLL_SECONDS = 0.05


class Done:
    """On a PS process: how many workers said they finished; `every` is set once `expected` have."""

    def __init__(self) -> None:
        self.lock, self.every = threading.Lock(), threading.Event()
        self.count, self.expected = 0, 0

    def one(self) -> None:
        with self.lock:
            self.count += 1
            if self.count >= self.expected:
                self.every.set()


_DONE = Done()


@transport.served
def rpc_done(rank: int) -> None:
    """A worker of the bench has finished (called on every PS process)."""
    _DONE.one()


@transport.answered_later
def rpc_until_gone() -> Future:
    """Served by a worker, answered never: a PS process's call to it ends (failed) when the
    worker's process has left the job."""
    return Future()


def _config(role: str, p: dict[str, Any], shard: int = 0):
    from app.config import parse

    argv = [role, "--world_size", str(p["world_size"]), "--master_addr", "127.0.0.1"]
    argv += ["--master_port", str(p["port"]), "--secret_file", p["secret_file"], "--socket_dir", p["socket_dir"]]
    argv += ["--model", "cnn", "--dataset", "synthetic", "--batch_size", str(SPECS[p["model"]].batch_size)]
    argv += ["--rpc_timeout", str(RPC_TIMEOUT), "--overlap", str(bool(p.get("overlap")))]
    argv += ["--compress", p.get("compress", "none"), "--strategy", p.get("strategy", "async")]
    argv += ["--exchange", p.get("exchange", "auto")]
    if role == "worker":
        argv += ["--rank", str(p["rank"])]
    if p.get("shards", 1) > 1:  # app-sharded: PS shards at ranks world_size.. (bench.procs)
        argv += ["--shards", str(p["shards"])]
    if shard:
        argv += ["--shard", str(shard)]
    return parse(argv, {})


def _prepare(config: Any) -> None:
    """What `python -m app` does at start: the allocator's setting and the thread count."""
    from app.runtime import machine

    machine.keep_freed_memory()
    machine.set_threads(machine.sharing_cpus(config))


def _part(p: dict[str, Any], index: int) -> tuple[int, int] | None:
    """Shard `index`'s slice of the state vector (app.ps.sharding.slices), or None unsharded."""
    if p.get("shards", 1) == 1:
        return None
    from app.ps.sharding.slices import bounds
    from app.training.flat import state_size

    return bounds(state_size(SPECS[p["model"]].model()), p["shards"])[index]


def shard_main(p: dict[str, Any]) -> dict[str, Any]:
    """app-sharded: PS shard `rank - workers` (the main PS is ps_main, shard 0)."""
    return ps_main(p, index=p["rank"] - (p["world_size"] - 1))


def ps_main(p: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """One PS process: serves the workers until each has said it is done and has left."""
    from app.contract import ps_name
    from app.exchange.ps_end import for_config
    from app.ps.rpc import Endpoint

    config = _config("ps", p, shard=index)
    _prepare(config)
    model, part = SPECS[p["model"]].model(), _part(p, index)
    shared = for_config(config, model, part, ps_name(index))
    server = _server(model, config.world_size - 1, part, config.strategy, shared)
    _DONE.expected = config.world_size - 1
    try:
        if index:  # a shard says where it listens in the main PS's store
            transport.wait_for_ps(config, RPC_TIMEOUT)
        with Endpoint(server).serving(), transport.session(config, p["rank"], ps_name(index)):
            if not _DONE.every.wait(timeout=p["timeout"]):
                raise TimeoutError(f"the workers did not finish within {p['timeout']} s")
            _until_workers_left(config.world_size - 1, p["timeout"])
    finally:
        shared.close()
    return {"version": server.version, "state_floats": int(server.state.flat.size)}


def _until_workers_left(workers: int, timeout: float) -> None:
    """Until every worker's process has left the job (their last answers from here are delivered
    by then): each call of `rpc_until_gone` ends as its worker leaves."""
    from app.contract import worker_name

    waiting = [transport.call_async(worker_name(r), rpc_until_gone, (), timeout) for r in range(1, workers + 1)]
    for call in waiting:
        try:
            call.wait()
        except RuntimeError:  # the worker is gone: what was waited for
            pass


def _server(model: Any, workers: int, part: Any, strategy: str, shared: Any) -> Any:
    """The app's ParameterServer at lr 0.01 without momentum, built from its parts' configs."""
    from app.ps.members.members import MembersConfig
    from app.ps.policies import PolicyConfig
    from app.ps.server import ParameterServer, ServerConfig
    from app.ps.state import StateConfig

    config = ServerConfig(StateConfig(lr=0.01, part=part), MembersConfig(workers), PolicyConfig(strategy))
    return ParameterServer(model, config, shared=shared)


def _wait_for_shards(config: Any, names: list[str], timeout: float) -> None:
    """Until every PS shard in `names` has said in the job's store where it listens."""
    keys = [f"{transport.ENDPOINT_KEY}{name}" for name in names]
    deadline = time.monotonic() + timeout
    with transport.store(config, timeout) as store:
        while not store.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"PS shards {', '.join(names)} did not listen within {timeout:.0f} s")
            time.sleep(POLL_SECONDS)


def _start(config: Any, p: dict[str, Any], channel: Any, shard_names: list[str]) -> Any:
    """The state to start from: the main PS's join, or (app-sharded) a pull from every PS
    process, through the worker's route to each of app.ps.sharding.slices' shards, listed here."""
    from app.contract import ps_name
    from app.exchange.calls import rpc_pull
    from app.exchange.socket_route import SocketRoute
    from app.exchange.wire import Progress, Start

    if not shard_names:
        return channel.join()
    _wait_for_shards(config, shard_names, RPC_TIMEOUT)
    routes = [SocketRoute(channel.pusher, ps_name(i), *_part(p, i)) for i in range(config.shards)]
    channel.route = channel.routed(routes)
    pulled = [transport.call(route.name, rpc_pull, (config.rank,), RPC_TIMEOUT) for route in routes]
    return Start(torch.cat([v for v, _ in pulled]), tuple(n for _, n in pulled), Progress(1, 0, 0))


def worker_main(p: dict[str, Any]) -> dict[str, Any]:
    from app.contract import PS, ps_name, worker_name
    from app.exchange.group import where
    from app.worker.channels import PSChannel
    from app.worker.trainer import Trainer

    config = _config("worker", p)
    _prepare(config)
    spec = SPECS[p["model"]]
    x, y = spec.batch(seed=p["rank"])
    shard_names = [ps_name(i) for i in range(1, config.shards)]
    channel = PSChannel(
        config.rank,
        config.rpc_timeout,
        where(config),
        exchange=config.exchange,
        sharded=bool(shard_names),
        overlap=config.overlap,
    )
    transport.wait_for_ps(config, RPC_TIMEOUT)
    with transport.session(config, config.rank, worker_name(config.rank)):
        start = _start(config, p, channel, shard_names)
        trainer = Trainer(config, spec.model(), None, None, torch.device("cpu"), channel, None)  # type: ignore[arg-type]
        trainer.start_from(start)  # and, through shared memory, backward writes into the push slots
        compute_only = loop.time_compute(lambda: trainer.compute_gradients(x, y), p["compute_seconds"])

        def step() -> tuple[float, float]:
            t0 = time.perf_counter()
            if p["compute"]:
                trainer.compute_gradients(x, y)
            t1 = time.perf_counter()
            trainer.push_and_pull(samples=len(y))  # --overlap: waits for the previous push only
            return t1 - t0, time.perf_counter() - t1

        result = loop.run(step, p, lockstep=config.strategy == "sync")
        trainer.last_reply()
        if p.get("idle_marker"):
            Path(p["idle_marker"]).touch()
            time.sleep(p["idle_seconds"])
        for name in [PS, *shard_names]:
            transport.call(name, rpc_done, (config.rank,), RPC_TIMEOUT)
    floats = trainer.flat.size
    push_bytes = floats * (2 if p.get("compress", "none") != "none" else 4)
    result.update(compute_only_s=compute_only, push_bytes=push_bytes, pull_bytes=4 * floats)
    return result
