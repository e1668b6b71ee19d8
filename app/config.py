"""Command line and PSC_* environment: one frozen Config, flag > env > default.

Pure: no torch import, so `python -m app health` and bad-flag errors are fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from app.contract import (COMPRESSIONS, DATASETS, DEVICES, ENV_PREFIX, IMAGE_CACHES, PRECISIONS, ROLES,
                          STRATEGIES, ps_name, worker_name)

_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
# The user's own model or dataset (app/common/plugins.py): package.module:factory.
ENTRY_POINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
# A run id names a directory (checkpoints set aside: <checkpoint_dir>/previous/<run id>/).
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class UsageError(Exception):
    """Bad input (flag, model, dataset, data dir, device): one line on stderr, exit 2."""


def _flag(default: Any, help: str, choices: tuple[str, ...] = ()) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Config:
    """Everything a process of the app needs; one field per flag of docs/design.md."""

    role: str
    model: str = _flag("resnet18", "`cnn` (built in), a torchvision classification model, "
                       "or your own as package.module:factory")
    dataset: str = _flag("imagefolder", f"where the samples come from: {', '.join(DATASETS)}, "
                         "or your own as package.module:factory")
    data_dir: str = _flag("./imagenette2/val", "data root (unused by digits and synthetic)")
    rank: int = _flag(1, "worker rank, 1..world_size-1 (the PS is always 0)")
    world_size: int = _flag(3, "PS + workers")
    master_addr: str = _flag("localhost", "the PS's address")
    master_port: int = _flag(6100, "the PS's rendezvous port")
    batch_size: int = _flag(256, "samples per batch, per worker")
    lr: float = _flag(0.01, "SGD learning rate (applied on the PS)")
    momentum: float = _flag(0.0, "SGD momentum (on the PS)")
    num_epochs: int = _flag(150, "epochs per worker over its shard")
    max_steps: int = _flag(0, "stop a worker after this many pushes (0: no cap)")
    device: str = _flag("cpu", "cpu or cuda (cuda:0, the one GPU a container sees)", DEVICES)
    strategy: str = _flag("async", "async: apply each gradient as it comes; sync: average one gradient per "
                          "worker per update; ssp: async, but no worker runs more than --staleness pushes "
                          "ahead of the slowest; allreduce: DDP, no PS", STRATEGIES)
    staleness: int = _flag(4, "ssp: how many pushes a worker may run ahead of the slowest live worker")
    staleness_lr: bool = _flag(False, "async/ssp: divide the lr of each push by its staleness (Zhang et al. 2016)")
    overlap: bool = _flag(False, "async/ssp: compute the next batch while the push and pull are on the wire "
                          "(one more step of staleness)")
    compress: str = _flag("none", "gradients on the wire: none (float32), bf16 or fp16, with error feedback",
                          COMPRESSIONS)
    precision: str = _flag("fp32", "forward/backward under autocast: fp32 (off), bf16 (CPU or CUDA) or fp16 "
                           "(CUDA, with loss scaling); parameters and pushed gradients stay float32", PRECISIONS)
    channels_last: bool = _flag(False, "CUDA: images (and, under allreduce, the model) in channels-last memory format")
    shards: int = _flag(1, "split the PS's state across this many PS processes (every role needs it)")
    shard: int = _flag(0, "ps: which shard this process serves; 0 is the main PS at --master_addr")
    checkpoint_dir: str = _flag("./checkpoints", "the PS writes its checkpoints and final.pt here")
    checkpoint_every: int = _flag(1000, "the PS checkpoints every K updates (and on SIGTERM); 0: only at the end")
    metrics_dir: str = _flag("./metrics", "JSON lines, one file per process")
    rpc_timeout: float = _flag(60.0, "seconds for every RPC and every wait")
    join_timeout: float = _flag(300.0, "seconds the PS waits for a missing worker to join or rejoin")
    seed: int = _flag(0, "model init, shuffling, synthetic data")
    eval_every: int = _flag(100, "the PS evaluates every K updates (and at the end)")
    log_every: int = _flag(10, "a worker prints every K batches")
    loader_workers: str = _flag("auto", "DataLoader worker processes: a number, or auto (the container's CPUs / "
                                "--host_workers, minus 1 for training, at most 8; app/common/host.py)")
    host_workers: int = _flag(1, "workers of this job sharing this host's CPUs (--loader_workers auto divides by it)")
    image_size: int = _flag(224, "imagefolder: the side of the square training crop, in pixels "
                            "(the shorter side is first resized to 8/7 of it, 256 for 224)")
    image_cache: str = _flag("auto", "imagefolder: decode each image of the process's shard once into uint8, "
                             "kept in shared memory (memory), in a file under --cache_dir (file), or not at all "
                             "(off); auto: memory when it fits, else off (true/false: memory/off); "
                             "crop, flip and normalise on --device", IMAGE_CACHES)
    cache_dir: str = _flag("./cache", "--image_cache file: where the decoded shards are kept")
    init_weights: str = _flag("", "a state dict file (or a final.pt) the model starts from; empty: none")
    run_id: str = _flag("", "this run's identity, written into every checkpoint: a PS resumes only its own "
                        "run's checkpoints (a new run sets older ones aside); empty: resume any")
    resume: bool = _flag(False, "a new run continues the newest checkpoint of an unfinished run (another "
                         "run id's) instead of starting at version 0")

    @property
    def num_trainers(self) -> int:
        """How many workers the PS serves."""
        return self.world_size - 1

    @property
    def name(self) -> str:
        """This process's RPC name: `ps`, `ps<shard>` or `worker<rank>`."""
        return ps_name(self.shard) if self.role == "ps" else worker_name(self.rank)


# (field, smallest allowed value, whether the bound itself is allowed)
_LOWER_BOUNDS = (
    ("world_size", 2, True), ("batch_size", 1, True), ("lr", 0.0, False),
    ("momentum", 0.0, True), ("num_epochs", 1, True), ("max_steps", 0, True),
    ("master_port", 1, True), ("rpc_timeout", 0.0, False), ("eval_every", 1, True),
    ("log_every", 1, True), ("host_workers", 1, True), ("seed", 0, True),
    ("checkpoint_every", 0, True), ("join_timeout", 0.0, False), ("staleness", 0, True),
    ("shards", 1, True), ("shard", 0, True), ("image_size", 8, True),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> _Parser:
    parser = _Parser(prog="python -m app", allow_abbrev=False,
                     description="Parameter-Server training over PyTorch RPC. "
                     "Every --flag may also be set as PSC_FLAG in the environment.")
    parser.add_argument("role", choices=ROLES)
    for f in dataclasses.fields(Config)[1:]:
        parser.add_argument(f"--{f.name}", type=str, default=None, metavar=f.type.upper(),
                            help=f"{f.metadata['help']} (default {f.default!r}, env {ENV_PREFIX}{f.name.upper()})")
    return parser


def _convert(f: dataclasses.Field, raw: str, source: str) -> Any:
    if f.name == "image_cache" and raw.strip().lower() in _BOOLS:  # the boolean it was before: on is memory
        return "memory" if _BOOLS[raw.strip().lower()] else "off"
    if f.name == "loader_workers":
        value = raw.strip().lower()
        if value != "auto" and not value.isdigit():
            raise UsageError(f"{source}: {raw!r} is not auto or a whole number >= 0")
        return value
    if f.type == "bool":
        if raw.strip().lower() not in _BOOLS:
            raise UsageError(f"{source}: {raw!r} is not one of true, false (or 1, 0)")
        return _BOOLS[raw.strip().lower()]
    kind = {"int": int, "float": float, "str": str}[f.type]
    try:
        value = kind(raw)
    except ValueError:
        raise UsageError(f"{source}: {raw!r} is not a valid {f.type}") from None
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise UsageError(f"{source}: {raw!r} is not one of {', '.join(choices)}")
    return value


def parse(argv: Sequence[str], env: Mapping[str, str]) -> Config:
    """Build the Config from argv (role first) and env; raise UsageError on bad input."""
    args = vars(_parser().parse_args(list(argv)))
    values: dict[str, Any] = {"role": args.pop("role")}
    for f in dataclasses.fields(Config)[1:]:
        env_name = ENV_PREFIX + f.name.upper()
        if args[f.name] is not None:
            values[f.name] = _convert(f, args[f.name], f"--{f.name}")
        elif env.get(env_name, "") != "":
            values[f.name] = _convert(f, env[env_name], env_name)
    config = Config(**values)
    validate(config)
    return config


def validate(config: Config) -> None:
    """Range checks that argparse cannot express; raise UsageError naming the flag."""
    if config.dataset not in DATASETS and not ENTRY_POINT.match(config.dataset):
        raise UsageError(f"--dataset: {config.dataset!r} is not one of {', '.join(DATASETS)}, "
                         "nor an entry point package.module:factory")
    if ":" in config.model and not ENTRY_POINT.match(config.model):
        raise UsageError(f"--model: {config.model!r} is not an entry point package.module:factory")
    for f in dataclasses.fields(Config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{f.name}: {value} is not a finite number")
    for name, low, inclusive in _LOWER_BOUNDS:
        value = getattr(config, name)
        if value < low or (value == low and not inclusive):
            relation = ">=" if inclusive else ">"
            raise UsageError(f"--{name}: {value} must be {relation} {low}")
    if config.run_id and not RUN_ID.match(config.run_id):
        raise UsageError(f"--run_id: {config.run_id!r} must be 1 to 64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    if config.master_port > 65535:
        raise UsageError(f"--master_port: {config.master_port} must be <= 65535")
    if config.momentum >= 1:
        raise UsageError(f"--momentum: {config.momentum} must be < 1")
    if config.shards > 8:
        raise UsageError(f"--shards: {config.shards} must be <= 8")
    if config.shard and (config.role != "ps" or config.shard >= config.shards):
        raise UsageError(f"--shard: {config.shard} is for the ps role, in 0..{config.shards - 1} "
                         f"(--shards {config.shards})")
    if config.precision == "fp16" and config.device != "cuda" and config.role == "worker":
        raise UsageError("--precision: fp16 needs --device cuda (loss scaling runs on the GPU); "
                         "on CPU use bf16")
    if config.shards > 1 and config.strategy == "allreduce":
        raise UsageError(f"--shards: {config.shards} needs a parameter server; strategy allreduce has none")
    if config.overlap and config.strategy in ("sync", "allreduce"):
        raise UsageError(f"--overlap: true is for strategies async and ssp; {config.strategy} "
                         "waits for every worker's gradient each step")
    if config.role == "check" and not 0 <= config.rank < config.world_size:
        raise UsageError(f"--rank: {config.rank} must be in 0..{config.world_size - 1} "
                         f"for the check (--world_size {config.world_size})")
    if config.role == "worker" and not 1 <= config.rank < config.world_size:
        raise UsageError(f"--rank: {config.rank} must be in 1..{config.world_size - 1} "
                         f"for a worker (--world_size {config.world_size})")


def check_threads_env(env: Mapping[str, str]) -> None:
    """OMP_NUM_THREADS, when set, must be one positive integer (torch takes no list)."""
    raw = env.get("OMP_NUM_THREADS", "")
    if raw and not (raw.strip().isdigit() and int(raw) >= 1):
        raise UsageError(f"OMP_NUM_THREADS: {raw!r} is not a positive integer (threads per process)")
