"""The values the app and the orchestrator must agree on, in one torch-free module.

Choices of the app's flags, the names of a job's processes (RPC, metrics file
and compose service), the patterns of an entry point and a run id, and the
metrics' file names and events. Pure: standard library only. This module and
app/options.py are the whole of the app the orchestrator imports (its host has
no torch); tests/orchestrator/test_import_graph.py holds both to the standard
library and the orchestrator to these two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Literal, get_args

ROLES = ("ps", "worker", "health", "check", "export")  # every `python -m app ROLE`
TRAINING_ROLES = ("ps", "worker")  # the roles that train (health and check are probes)
# `python -m app check` ends with one line: this mark, then a JSON object, its result for the
# orchestrator (its other lines are for people): rank, name, passed (bool), failed (the
# problem, or null), blame (the rank names it holds responsible), unreachable (it never
# reached rank 0), called_off (rank 0 ended the check), report (rank 0: its `check:` lines).
CHECK_RECORD = "psc-check-record "
StrategyName = Literal["async", "sync", "ssp", "allreduce", "diloco", "diloco_async"]
STRATEGIES: tuple[str, ...] = get_args(StrategyName)
PS_STRATEGIES = ("async", "ssp", "sync", "diloco", "diloco_async")  # the strategies with a parameter server
Compression = Literal["none", "bf16", "fp16"]
COMPRESSIONS: tuple[str, ...] = get_args(Compression)
Exchange = Literal["auto", "transport"]  # how pushes cross: shared memory where it can be had, or the sockets
EXCHANGES: tuple[str, ...] = get_args(Exchange)
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
DATASETS = ("imagefolder", "mnist", "cifar10", "digits", "synthetic", "stdlib_text", "webdataset")  # built in
# The datasets the app reads from files under --data_dir (the others ship in a package or are
# generated, and need no mount).
FILE_DATASETS = frozenset({"imagefolder", "mnist", "cifar10", "webdataset"})
# webdataset's --data_dir (and --eval_data) is a pattern of tar shards, not a directory.
SHARD_DATASETS = frozenset({"webdataset"})
# --data_dir (and --eval_data) may be a URL of these schemes, read through fsspec (s3 through s3fs):
# never mounted, handed to the app as given.
DATA_URL_SCHEMES = ("http", "https", "s3")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# What s3:// data needs of the caller's environment: every process of the job gets these names
# (their values from the caller; never written into a rendered file).
S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


def url_scheme(path: str) -> str | None:
    """The scheme of `path` when it is a URL (`s3` of s3://bucket/x), lower case; None for a local path."""
    found = _URL.match(path)
    return found.group(1).lower() if found else None


NO_PS_STRATEGY = "allreduce"  # DDP: no parameter server, worker1 is rank 0
Device = Literal["cpu", "cuda"]
DEVICES: tuple[str, ...] = get_args(Device)
ImageCache = Literal["auto", "off", "memory", "file"]  # imagefolder's decoded-image cache (app/data/imagecache.py)
IMAGE_CACHES: tuple[str, ...] = get_args(ImageCache)

# The user's own model or dataset (app/plugins.py): package.module:factory.
ENTRY_POINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
# A run id names a directory (checkpoints set aside: <checkpoint_dir>/previous/<run id>/; TensorBoard's runs).
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

ENV_PREFIX = "PSC_"  # every flag --x is also PSC_X in the environment
RUN_ID_ENV = "PSC_RUN_ID"  # the run's id, written into the `start` record when set
# Where a process keeps the one line of a mistake that fails it the same way each time (a bad
# flag, a plug-in that fails on its first batch: exit 2), so that a restart of its container says
# it again and exits 0 instead of failing again (compose restarts on failure; app/stops.py).
# A path in the container's own filesystem: a restart keeps it, a new container starts without it.
STOP_FILE_ENV = "PSC_STOP_FILE"
# The PS's MLflow server as the host reaches it (PSC_MLFLOW_UI) where the PS reaches it at
# another address (PSC_MLFLOW_SERVER: the project's own server, inside its network): the run's
# address in the PS's log is the host's.
MLFLOW_UI_ENV, MLFLOW_SERVER_ENV = "PSC_MLFLOW_UI", "PSC_MLFLOW_SERVER"

PS = "ps"  # the main PS: RPC name, metrics file and compose service
SHARD_SERVICE = "ps-shard{index}"  # compose service of PS shard index >= 1
METRICS_SUFFIX = ".jsonl"
# What MLflow had not taken when a run ended: <metrics dir>/mlflow-pending/<run id>/, written by the
# PS (app/training/tracking_pending.py), sent by `ps-compose runs sync` (orchestrator/verbs/mlflow_sync.py).
MLFLOW_RUN_TAG = "ps-compose.run_id"  # the tag the PS gives its MLflow run: the job's run id
MLFLOW_PENDING_DIR = "mlflow-pending"
# Besides the run's own metrics (an eval record's `metrics`: accuracy, perplexity, the user's).
MLFLOW_EVAL_METRICS = ("accuracy", "loss", "lr", "samples_per_s", "updates_per_s", "staleness", "workers")
MLFLOW_WORKER_METRICS = ("loss", "samples_per_s")  # a worker's, as its pushes carry them to the PS


def mlflow_points(event: str, fields: dict, now_ms: int) -> list[tuple[str, float, int]]:
    """The MLflow metrics (key, value, timestamp in ms) of one record the PS logs at its step:
    an `eval` or `end` record's numbers (and `training_seconds`, the test split's at the end), or
    a `worker` record's loss and samples/s as `<worker>/loss`. The timestamp is the record's
    `time`, else `now_ms`; the same record gives the same points (the tracker's, and a sync's)."""
    stamp = int(fields["time"] * 1000) if isinstance(fields.get("time"), (int, float)) else now_ms
    if event == "worker":
        prefix = re.sub(r"[^\w.-]", "_", str(fields.get("worker", "worker")))
        names: list[str] = [f"{prefix}/{k}" for k in MLFLOW_WORKER_METRICS]
        numbers = {f"{prefix}/{k}": fields.get(k) for k in MLFLOW_WORKER_METRICS}
    else:
        tested = [k for k in fields if event == "end" and k.startswith("test_")]  # the test split's
        names = list(dict.fromkeys([*fields.get("metrics", ()), *MLFLOW_EVAL_METRICS, *tested]))
        numbers = {k: fields.get(k) for k in names}
        if event == "end":
            names.append("training_seconds")
            numbers["training_seconds"] = fields.get("seconds")
    return [
        (k, float(v), stamp) for k in names if isinstance(v := numbers[k], (int, float)) and not isinstance(v, bool)
    ]


# TensorBoard's event files: <metrics_dir>/tensorboard/<run id>/<process name>/ (app/training/event_files.py)
TENSORBOARD_DIR = "tensorboard"
UNNAMED_RUN = "unnamed"  # the run directory of processes started without a run id


class Event(str, Enum):
    """The metrics events (docs/design.md): what a process writes, one JSON object a line, its
    `event` field. A member equals its string (`Event.JOIN == "join"`)."""

    START = "start"
    JOIN = "join"
    TRAIN = "train"
    EVAL = "eval"
    END = "end"
    CHECKPOINT = "checkpoint"
    RESUME = "resume"
    DROP = "drop"
    BACK = "back"
    LEFT = "left"
    FROZEN = "frozen"
    REFUSED = "refused"
    SHARD = "shard"
    SHARD_LOST = "shard_lost"


EVENTS = tuple(e.value for e in Event)


# The PS's shared-memory segment for the same-host exchange (app.exchange.ps_end, app.exchange.segment):
# a page of header, then for each possible worker its push slots (one, two with --overlap) and
# reply buffers (one, two with --overlap), and under sync a round's two reply buffers; every region holds the state's
# float32 values, rounded up to a page. The render sizes /dev/shm from this; the PS makes it.


@dataclass(frozen=True)
class Strategy:
    """What a strategy is, as the app's parts ask it: the one place its name means something
    (`strategy_of(config.strategy)`; the option's choices are STRATEGIES). Every other module
    asks these properties, never the name."""

    name: str
    has_ps: bool = True  # allreduce: the workers average among themselves (DDP), no PS
    rounds: bool = False  # sync: one averaged update a round of one push from every live worker
    bounded: bool = False  # ssp: a worker `staleness` pushes ahead of the slowest live one waits
    # diloco, diloco_async: a worker takes train.local_steps steps of its own optimizer, then pushes
    # the change of its parameters since its last pull; the PS steps train.outer_optimizer with it
    local: bool = False

    @property
    def waits(self) -> bool:
        """A push may wait for other workers (sync's round, ssp's bound): its reply is held, and
        the worker's RPC allows for it; async answers every push at once."""
        return self.rounds or self.bounded

    @property
    def allows_overlap(self) -> bool:
        """--overlap: the next batch computes while the push is out (async and ssp; a local
        strategy pushes once every train.local_steps batches)."""
        return self.has_ps and not self.rounds and not self.local


STRATEGY_OF = {
    s.name: s
    for s in (
        Strategy("async"),
        Strategy("sync", rounds=True),
        Strategy("ssp", bounded=True),
        Strategy("allreduce", has_ps=False),
        Strategy("diloco", rounds=True, local=True),
        Strategy("diloco_async", local=True),
    )
}


def strategy_of(name: str) -> Strategy:
    """The Strategy named `name` (one of STRATEGIES); ValueError for any other name."""
    try:
        return STRATEGY_OF[name]
    except KeyError:
        raise ValueError(f"strategy {name!r}: one of {', '.join(STRATEGIES)}") from None


SHM_PAGE = 4096


def exchange_regions(max_workers: int, overlap: bool, sync: bool) -> int:
    """How many regions a PS process's segment holds."""
    per_worker = 2 * (2 if overlap else 1)  # its push slots and its reply buffers
    return max_workers * per_worker + (2 if sync else 0)


def exchange_bytes(floats: int, max_workers: int, overlap: bool, sync: bool) -> int:
    """The size of a PS process's segment for a state (or a shard's slice) of `floats` values."""
    stride = -(-floats * 4 // SHM_PAGE) * SHM_PAGE
    return SHM_PAGE + exchange_regions(max_workers, overlap, sync) * stride


def worker_name(rank: int) -> str:
    """Worker `rank`'s name (1..N): its first RPC name, metrics file and compose service."""
    return f"worker{rank}"


def ps_name(shard: int = 0) -> str:
    """PS shard `shard`'s RPC and metrics file name: `ps` for the main PS, else `ps<shard>`."""
    return f"ps{shard}" if shard else PS


def shard_service(index: int) -> str:
    """The compose service of PS shard `index` >= 1."""
    return SHARD_SERVICE.format(index=index)


def process_name(role: str, rank: int, shard: int = 0) -> str:
    """The name a process of `role` registers under (its first RPC name) and names its metrics
    file after: `ps`, `ps<shard>`, `worker<rank>`."""
    return ps_name(shard) if role == PS else worker_name(rank)


def metrics_file(name: str) -> str:
    """The metrics file of the process named `name` (ps, ps1, worker2...)."""
    return f"{name}{METRICS_SUFFIX}"


def event_dir(metrics_dir: str, run_id: str, name: str) -> str:
    """The TensorBoard event directory of process `name` (ps, ps1, worker2...) in run `run_id`."""
    return "/".join((metrics_dir.rstrip("/"), TENSORBOARD_DIR, run_id or UNNAMED_RUN, name))


def service_names(world_size: int, strategy: str, shards: int = 1) -> list[str]:
    """The job's compose services in rank order: `ps`, its shards `ps-shard1..`, then the
    workers; under allreduce the workers alone (rank r is `worker<r+1>`)."""
    if not strategy_of(strategy).has_ps:
        return [worker_name(r + 1) for r in range(world_size)]
    ps = [PS] + [shard_service(i) for i in range(1, shards)]
    return ps + [worker_name(r) for r in range(1, world_size - len(ps) + 1)]


_USER_INFO = re.compile(r"(\w+://)[^/@\s]+@")


def shown(text: str) -> str:
    """`text` with the user and password of every URI in it left out (what a log line or an
    error may say of a tracking server's address)."""
    return _USER_INFO.sub(r"\1***@", text)
