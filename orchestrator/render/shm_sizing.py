"""How much /dev/shm a compose job needs, with and without one shared IPC namespace.

With `network.same_host_copy` the PS, its shards and the workers share one IPC namespace, held
by the `pidns` service, and so one /dev/shm: the PS's shared-memory segments for the exchange
(app.contract.exchange_bytes, from the model's state size in app.model_sizes) live there beside
what each container used to have on its own (ps.shm_size per PS process, workers.shm_size per
possible worker: DataLoader batches, the image cache). The holder's shm_size is their sum. It
is a limit, not a reservation: memory is used only as it is written. An allreduce job on one
host shares the holder's namespaces too: its workers' shm_size, no PS and no exchange.
"""

from __future__ import annotations

import math

from app.contract import exchange_bytes, strategy_of
from app.model_sizes import STATE_FLOATS
from orchestrator.topology.model import Topology, size_bytes

MIB = 1024**2


def exchange_estimate(t: Topology) -> int | None:
    """Bytes of the PS's segments (one per PS process, each for its slice of the state);
    None for a model whose size is not known here (a user's own: it comes out of ps.shm_size)."""
    floats = STATE_FLOATS.get(t.train.model)
    if floats is None:
        return None
    shards, train = t.ps.shards, t.train
    sync = strategy_of(train.strategy).rounds
    return shards * exchange_bytes(math.ceil(floats / shards), t.max_workers, train.overlap, sync)


def shared_shm_bytes(t: Topology) -> int:
    """The shared /dev/shm of a job in one IPC namespace: every PS process's ps.shm_size, every
    possible worker's workers.shm_size, and the exchange's segments."""
    workers = t.max_workers * size_bytes(t.workers.shm_size)
    if not strategy_of(t.train.strategy).has_ps:
        return workers
    return t.ps.shards * size_bytes(t.ps.shm_size) + workers + (exchange_estimate(t) or 0)


def compose_size(n: int) -> str:
    """`n` bytes as compose writes a size, rounded up to a MiB ('14432m')."""
    return f"{-(-n // MIB)}m"
