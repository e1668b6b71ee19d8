"""The services of a topology, derived once: name, role, rank, shard, GPU, metrics file.

Every verb that needs to know what a service is (local, check, chaos, swarm,
cluster) reads it from `services(t)` instead of parsing the service's name.
Names follow the app's (app/contract.py, the one place they are declared): `ps`,
`ps-shard1..` (RPC name and metrics file `ps1..`), `worker1..workerN`; allreduce has
no PS, and worker1 is its rank 0 host.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Optional

from app.contract import PS, TRAINING_ROLES, process_name, shard_service, strategy_of, worker_name
from app.contract import metrics_file as file_of
from orchestrator.topology.model import Topology

Role = Literal["ps", "worker"]

PS_SERVICE = PS
# compose with network.same_host_copy: holds the PID namespace the job's containers share (render/compose.py).
PIDNS_SERVICE = "pidns"
# Labels on every rendered service (and so on every container), for status by filter.
LABEL_PROJECT = "ps-compose.project"
LABEL_ROLE = "ps-compose.role"
LABEL_RANK = "ps-compose.rank"
SCRATCH_LABEL = "ps-compose.scratch"  # a one-off container of a project's (its metrics read, its export)


def has_ps(t: Topology) -> bool:
    """Every strategy but allreduce runs a PS."""
    return strategy_of(t.train.strategy).has_ps


def rendezvous_service(t: Topology) -> str:
    """The service that hosts rank 0 and the rendezvous (PSC_MASTER_ADDR): `ps`, or
    `worker1` for allreduce. Its `end` record carries the job's final accuracy."""
    return PS_SERVICE if has_ps(t) else worker_name(1)


def service_names(t: Topology) -> list[str]:
    """`ps` (unless allreduce) and its shards `ps-shard1..`, then `worker1..workerN`, in rank order."""
    workers = [worker_name(r) for r in range(1, t.workers.count + 1)]
    shards = [shard_service(i) for i in range(1, t.ps.shards)]
    return [PS_SERVICE] + shards + workers if has_ps(t) else workers


def describe(t: Topology) -> str:
    """`ps + 3 workers`, or `3 workers (allreduce, no ps)`, for the verbs' messages."""
    if has_ps(t):
        shards = f" + {t.ps.shards - 1} shard{'s' * (t.ps.shards > 2)}" if t.ps.shards > 1 else ""
        return f"ps{shards} + {t.workers.count} workers"
    return f"{t.workers.count} workers (allreduce, no ps)"


@dataclass(frozen=True)
class Service:
    """One process of the job.

    Invariants: `rank` is the app's PSC_RANK (0 for the PS and every shard; k for
    worker k); `shard` is 0 except for `ps-shard<i>` (then i, its PSC_SHARD);
    `gpu` is the host GPU id the service reserves (None: CPU); `metrics_file` is
    the file the app writes under the metrics directory (named after the RPC name).
    """

    name: str
    role: Role
    rank: int
    shard: int
    gpu: Optional[int]
    metrics_file: str

    @property
    def rpc_name(self) -> str:
        """The name the process registers under (first incarnation): ps, ps1.., worker1.."""
        return process_name(self.role, self.rank, self.shard)


def services(t: Topology) -> list[Service]:
    """The services of `t` in `service_names` order (rank order, shards after the PS)."""
    out: list[Service] = []
    if has_ps(t):
        out.append(Service(PS_SERVICE, "ps", 0, 0, t.ps_gpu(), metrics_file("ps", 0, 0)))
        for index in range(1, t.ps.shards):
            out.append(Service(shard_service(index), "ps", 0, index, t.ps_gpu(), metrics_file("ps", 0, index)))
    gpus = t.worker_gpus()
    for rank in range(1, t.workers.count + 1):
        out.append(
            Service(
                worker_name(rank),
                "worker",
                rank,
                0,
                gpus[rank - 1] if gpus else None,
                metrics_file("worker", rank, 0),
            )
        )
    return out


def metrics_file(role: Role, rank: int, shard: int) -> str:
    """The file the app names after its RPC name: ps.jsonl, ps<shard>.jsonl, worker<rank>.jsonl."""
    return file_of(process_name(role, rank, shard))


def described(name: str, labels: Mapping[str, str], env: Mapping[str, str], gpu: Optional[int]) -> Optional[Service]:
    """The service a rendered service or its container describes by its labels (role,
    rank) and environment (PSC_SHARD); None when it carries no ps-compose labels
    (a scratch or foreign container)."""
    role, rank = labels.get(LABEL_ROLE), labels.get(LABEL_RANK)
    if role not in TRAINING_ROLES or rank is None or not str(rank).isdigit():
        return None
    kind: Role = "ps" if role == "ps" else "worker"
    shard = int(env.get("PSC_SHARD", "0") or 0) if kind == "ps" else 0
    return Service(name, kind, int(rank), shard, gpu, metrics_file(kind, int(rank), shard))


def sort_key(s: Service) -> tuple:
    """Rank order as the render lists services: the PS, its shards, then workers by rank."""
    return (s.role != "ps", s.shard, s.rank, s.name)


def by_name(t: Topology) -> dict[str, Service]:
    """`services(t)` keyed by service name (insertion order is rank order)."""
    return {s.name: s for s in services(t)}


def order(names: Iterable[str], t: Optional[Topology] = None) -> list[str]:
    """`names` (services found on an engine) in rank order: those of `t` first, in
    `services(t)` order; then the others (or all, without `t`) in natural order,
    `ps` first (ps, ps-shard1, worker2, worker10)."""
    names = list(dict.fromkeys(names))
    known = [s.name for s in services(t)] if t is not None else []
    first = [n for n in known if n in names]
    rest = sorted((n for n in names if n not in first), key=_natural)
    return first + rest


def _natural(name: str) -> tuple:
    parts = re.split(r"(\d+)", name)
    return (name != PS_SERVICE, [int(p) if p.isdigit() else p for p in parts])
