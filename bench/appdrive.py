"""The app's own PS and worker code paths, driven by the bench.

What is the app's: the PS's update (`app.ps.server.ParameterServer` behind the
`app.exchange.calls.rpc_*` calls the workers make), the worker's step
(`app.worker.trainer.Trainer.compute_gradients` and `push_and_pull` through
`app.worker.channels.PSChannel`), the flat buffers (`app.training.flat`), the TensorPipe
options (`app.exchange.tensorpipe.backend_options`) and thread count
(`app.runtime.machine.set_threads`). What is the bench's: the model (bench.models),
a fixed synthetic batch, and the lifecycle of the RPC group (a static group
with a graceful end), so that changes to the app's membership and failure
handling do not change what is measured. Every use of the app's interfaces
is in this file: when they change, this file is adapted.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc

from bench import loop
from bench.models import SPECS

ADDR = "127.0.0.1"
RPC_TIMEOUT = 120
_DONE = {"event": threading.Event(), "count": 0, "expected": 0}


def rpc_done(rank: int) -> None:
    """A worker of the bench has finished (called on the PS process)."""
    _DONE["count"] += 1
    if _DONE["count"] >= _DONE["expected"]:
        _DONE["event"].set()


def _config(role: str, p: dict[str, Any]):
    from app.config import parse

    argv = [
        role,
        "--world_size",
        str(p["world_size"]),
        "--master_addr",
        ADDR,
        "--master_port",
        str(p["port"]),
        "--model",
        "cnn",
        "--dataset",
        "synthetic",
        "--batch_size",
        str(SPECS[p["model"]].batch_size),
        "--rpc_timeout",
        str(RPC_TIMEOUT),
        "--overlap",
        str(bool(p.get("overlap"))),
        "--compress",
        p.get("compress", "none"),
        "--strategy",
        p.get("strategy", "async"),
        "--exchange",
        p.get("exchange", "auto"),
    ]
    if role == "worker":
        argv += ["--rank", str(p["rank"])]
    if p.get("shards", 1) > 1:  # app-sharded: PS shards at RPC ranks world_size.. (bench.procs)
        argv += ["--shards", str(p["shards"])]
    return parse(argv, {})


def _init(config: Any, name: str, rank: int) -> None:
    from app.runtime import machine

    try:
        from app.exchange import tensorpipe as transport
    except ImportError:  # a baseline under --app-path from before the transport's choice
        from app.exchange import transport  # type: ignore[no-redef]

    machine.keep_freed_memory()  # what `python -m app` does at start
    world = config.world_size + config.shards - 1
    machine.set_threads(machine.sharing_cpus(config))  # as `python -m app` does
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=transport.backend_options(config))


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
    from app.contract import ps_name
    from app.exchange.ps_end import for_config
    from app.ps import rpc

    config = _config("ps", p)
    model, part = SPECS[p["model"]].model(), _part(p, index)
    shared = for_config(config, model, part, ps_name(index))
    server = _server(model, config.world_size - 1, part, config.strategy, shared)
    _DONE["expected"] = config.world_size - 1
    # an Endpoint built per serving; a baseline under --app-path before it: the process-wide one
    serving = rpc.ENDPOINT.serving(server) if hasattr(rpc, "ENDPOINT") else rpc.Endpoint(server).serving()
    try:
        with serving:
            _init(config, ps_name(index), p["rank"])
            if not _DONE["event"].wait(timeout=p["timeout"]):
                raise TimeoutError(f"the workers did not finish within {p['timeout']} s")
            loop.shutdown_after_steps(ps_name(index), graceful=True, timeout=RPC_TIMEOUT)
    finally:
        if shared is not None:  # None: a baseline before NO_SEGMENT
            shared.close()
    return {"version": server.version, "state_floats": _state_floats(server)}


def _server(model: Any, workers: int, part: Any, strategy: str, shared: Any) -> Any:
    """The app's ParameterServer at lr 0.01 without momentum; built from its parts' configs, or
    (a baseline under --app-path, before them) from keywords."""
    try:
        from app.ps.members.members import MembersConfig
        from app.ps.policies import PolicyConfig
        from app.ps.server import ParameterServer, ServerConfig
        from app.ps.state import StateConfig
    except ImportError:
        from app.ps.server import ParameterServer

        return ParameterServer(
            model, lr=0.01, momentum=0.0, num_trainers=workers, part=part, strategy=strategy, shared=shared
        )
    config = ServerConfig(StateConfig(lr=0.01, part=part), MembersConfig(workers), PolicyConfig(strategy))
    return ParameterServer(model, config, shared=shared)


def _state_floats(server: Any) -> int:
    """The whole state's values (the PS's flat model: its `state`'s, or a baseline's own)."""
    flat = server.state.flat if hasattr(server.state, "flat") else server.flat
    return int(flat.size)


def _starting(vector: Any, version: Any) -> Any:
    """What the app's Trainer.start_from takes at rank 0's start: app.exchange.wire.Start, or the
    dict an app before it took (a baseline under --app-path)."""
    try:
        from app.exchange.wire import Progress, Start
    except ImportError:
        return {"vector": vector, "version": version, "pushes": 0, "epoch": 1, "batch": 0}
    return Start(vector, version, Progress(1, 0, 0))


def worker_main(p: dict[str, Any]) -> dict[str, Any]:
    from app.contract import PS, ps_name, worker_name
    from app.exchange.calls import rpc_pull
    from app.worker.channels import PSChannel
    from app.worker.links import TensorPipeLink
    from app.worker.trainer import Trainer

    config = _config("worker", p)
    spec = SPECS[p["model"]]
    x, y = spec.batch(seed=p["rank"])
    shard_names = [ps_name(i) for i in range(1, config.shards)]
    channel = PSChannel(
        config.rank, config.rpc_timeout, f"{ADDR}:{p['port']}", sharded=bool(shard_names), overlap=config.overlap
    )
    _init(config, worker_name(config.rank), config.rank)
    if shard_names:  # app-sharded: the worker's links to app.ps.sharding.slices' shards, listed here
        cpu = torch.device("cpu")
        channel.links = [TensorPipeLink(ps_name(i), *_part(p, i), cpu, config.overlap) for i in range(config.shards)]
        pulled = [rpc.rpc_sync(link.name, rpc_pull, args=(config.rank,)) for link in channel.links]
        start = _starting(torch.cat([v for v, _ in pulled]), tuple(n for _, n in pulled))
    else:
        start = channel.join()
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
        rpc.rpc_sync(name, rpc_done, args=(config.rank,), timeout=RPC_TIMEOUT)
    loop.shutdown_after_steps(config.name, graceful=True, timeout=RPC_TIMEOUT)
    floats = trainer.flat.size
    push_bytes = floats * (2 if p.get("compress", "none") != "none" else 4)
    result.update(compute_only_s=compute_only, push_bytes=push_bytes, pull_bytes=4 * floats)
    return result
