"""An allreduce job's world: which rank this process is among how many, the rendezvous that
makes them one process group, and the barrier they leave by.

The world is the workers alone: DDP rank = --rank - 1 and world size = --world_size - 1 (the
config counts a PS slot). The rendezvous: with --socket_dir (every rank on one host: `local`, and
compose, where the workers share one network namespace) a c10d FileStore in that private
directory (app.allreduce.filestore), Gloo and NCCL on the loopback: no TCP listener off it; else
a c10d TCPStore that rank 0 hosts at --master_addr:--master_port (swarm, Kubernetes, by hand).
Under torchrun, its RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK) win (its TCPStore).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from app.allreduce import filestore
from app.config import Config, UsageError
from app.runtime import lifecycle, machine, words

log = logging.getLogger("app.allreduce")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class PeerLost(RuntimeError):
    """A collective failed: another rank died, or did not answer within --rpc_timeout."""


@dataclass(frozen=True)
class World:
    """This process's place in the DDP job."""

    rank: int  # 0..size-1; rank 0 is worker1
    size: int  # the number of workers
    addr: str
    port: int
    local_rank: int  # torchrun's LOCAL_RANK: the GPU of this process on a multi-GPU node
    torchrun: bool  # the rendezvous comes from torchrun's environment (init_method env://)
    store_dir: str = ""  # the private directory of a FileStore rendezvous; "": a TCPStore at addr:port

    def where(self) -> str:
        """Where the rendezvous is, for messages."""
        return f"files in {self.store_dir}" if self.store_dir else f"{self.addr}:{self.port}"


def world_of(config: Config, env: Mapping[str, str]) -> World:
    """torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT when all are set, else the config's."""
    if all(env.get(k) for k in TORCHRUN_ENV):
        try:
            rank, size, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
            local_rank = int(env.get("LOCAL_RANK") or 0)
        except ValueError:
            raise UsageError(
                "torchrun's RANK, WORLD_SIZE, MASTER_PORT and LOCAL_RANK must be whole numbers, "
                f"got {', '.join(f'{k}={env.get(k)!r}' for k in (*TORCHRUN_ENV, 'LOCAL_RANK'))}"
            ) from None
        if not 0 <= rank < size:
            raise UsageError(f"RANK {rank} must be in 0..{size - 1} (WORLD_SIZE {size})")
        return World(rank, size, env["MASTER_ADDR"], port, local_rank, True)
    return World(
        config.rank - 1, config.num_trainers, config.master_addr, config.master_port, 0, False, config.socket_dir
    )


def reason(error: BaseException) -> str:
    """The gist of a gloo/NCCL error: its first sentence, without the source location."""
    return re.sub(r"^\[[^\]]*\]\s*", "", words.first_line(error)).split(". ")[0]


def rendezvous(world: World, device: torch.device, timeout: float) -> str:
    """Join the process group (every rank waits for all); the backend's name."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    machine.set_gloo_interface("127.0.0.1" if world.store_dir else world.addr)
    where = world.where()
    with lifecycle.deadline(timeout + 10, f"rank {world.rank}: the rendezvous at {where}"):
        try:
            if world.store_dir:
                dist.init_process_group(
                    backend,
                    store=file_store(world, timeout),
                    rank=world.rank,
                    world_size=world.size,
                    timeout=timedelta(seconds=timeout),
                )
            else:
                init = "env://" if world.torchrun else f"tcp://{world.addr}:{world.port}"
                dist.init_process_group(
                    backend,
                    init_method=init,
                    rank=world.rank,
                    world_size=world.size,
                    timeout=timedelta(seconds=timeout),
                )
        except (RuntimeError, ValueError, TimeoutError) as error:  # DistStoreError, DistNetworkError...
            raise PeerLost(
                f"the rendezvous of {words.counted(world.size, 'worker')} at {where} failed "
                f"within --rpc_timeout {timeout:.0f} s: {reason(error)}"
            ) from error
    return backend


def file_store(world: World, timeout: float) -> dist.FileStore:
    """The FileStore of this attempt of the job (app.allreduce.filestore): rank 0 makes it, the
    others wait (up to `timeout`) for rank 0's."""
    if world.rank == 0:
        path = filestore.publish(world.store_dir)
    else:
        path = filestore.find(world.store_dir, time.monotonic() + timeout)
    store = dist.FileStore(path, world.size)
    store.set_timeout(timedelta(seconds=timeout))
    return store


def leave_together(world: World) -> None:
    """A last barrier: every rank is past its last step before any of them exits
    (an exit while a peer still reads from it would fail that peer's step)."""
    try:
        dist.barrier()
    except RuntimeError as error:  # every step was done: the job's result stands
        log.warning(
            "rank %d: a peer left before the final barrier (%s); every step was done", world.rank, reason(error)
        )
