"""The one module of the app that imports torch.distributed.rpc: the `tensorpipe` transport
(app.exchange.transport chooses it with --transport tensorpipe). How a process joins the job's
RPC group, calls another by name (and waits, or not), serves calls whose answer comes later,
reads the group's store, and leaves. RPC and TensorPipe are in maintenance mode upstream, and
RPC unpickles a callable from whoever connects: the job's own transport (app.exchange.node)
replaces it.

TensorPipe: the `uv` (TCP) transport only. The default `shm` transport spins a core while idle;
`cuda_ipc` crashes with one GPU per container (pytorch#95487), so the channels are listed
explicitly and tensors cross on CPU. `cma` (one process_vm_readv copy) is taken between processes
of one PID namespace, the local runs; it costs ~40% less CPU than `mpt_uv` per tensor (`python -m
bench constants`: rpc_cma_cpu_s, rpc_mpt_uv_cpu_s). Containers have a PID namespace each, so
TensorPipe passes over it there and takes `mpt_uv`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.futures import Future

from app.config import Config
from app.runtime.lifecycle import deadline
from app.runtime.machine import LOOPBACK

log = logging.getLogger("app")
TRANSPORTS = ["uv"]
CHANNELS = ["cma", "mpt_uv", "basic"]
F = TypeVar("F", bound=Callable[..., Any])


def backend_options(config: Config) -> rpc.TensorPipeRpcBackendOptions:
    """The group's TensorPipe settings for the job `config` describes."""
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{config.master_addr}:{config.master_port}",
        rpc_timeout=config.rpc_timeout,
        num_worker_threads=max(8, 2 * (config.max_trainers + 1)),  # every worker the job may be scaled to
        _transports=TRANSPORTS,
        _channels=CHANNELS,
    )


@contextmanager
def session(config: Config, rank: int, name: str | None = None) -> Iterator[None]:
    """Be in the job's RPC group as `name` (default config.name) with RPC id `rank`.

    The group is dynamic (`world_size=None`): the PS (id 0) starts it, workers join and leave at
    any time (app.exchange.group says why each piece is as it is). Joining is bounded by
    rpc_timeout. Leaving never waits for peers (`graceful=False`): a graceful shutdown waits for
    every member, so one dead member would hang it, and a graceful leave of a dynamic group calls
    every member. Every RPC a process cares about has returned by then.
    """
    name = name or config.name
    if config.master_addr in LOOPBACK:
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    with deadline(config.rpc_timeout, f"{name}: joining the job at {config.master_addr}:{config.master_port}"):
        rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=backend_options(config))
    log.info("%s joined the job", name)
    try:
        yield
    finally:
        with deadline(config.rpc_timeout + 10, f"{name}: RPC shutdown"):
            rpc.shutdown(graceful=False)


def call(to: str, function: Callable[..., Any], args: tuple[Any, ...] = (), timeout: float = -1) -> Any:
    """`function(*args)` run in the process named `to`; its answer (RuntimeError when the call
    failed or timed out: `timeout` seconds, -1 the group's default)."""
    return rpc.rpc_sync(to, function, args=args, timeout=timeout)


def call_async(to: str, function: Callable[..., Any], args: tuple[Any, ...] = (), timeout: float = -1) -> Future:
    """The same, not waited for: a future of the answer (`.wait()` raises as `call` does)."""
    return rpc.rpc_async(to, function, args=args, timeout=timeout)


def answered_later(function: F) -> F:
    """A served function that returns a Future of its answer: the call holds no thread of the
    server while the answer waits (torch's `async_execution`)."""
    return rpc.functions.async_execution(function)


def stores() -> tuple[dist.Store, dist.Store]:
    """The group's store (the PS's TCP store) and, under its `names/` prefix, the member list
    (app.ps.members.listing keeps it short)."""
    agent = rpc.api._get_current_rpc_agent()
    if not isinstance(agent, rpc.TensorPipeAgent):  # the only RPC agent with a store
        raise RuntimeError(f"the membership store needs the TensorPipe RPC agent, not {type(agent).__name__}")
    return agent.store, dist.PrefixStore("names", agent.store)


def store_client(master_addr: str, master_port: int, timeout: float) -> dist.TCPStore:
    """A client of the PS's store."""
    return dist.TCPStore(master_addr, master_port, is_master=False, timeout=timedelta(seconds=timeout))
