"""Command line and PSC_* environment: one frozen Config, flag > env > default.

The options, their kinds, defaults, bounds and help are declared in app/options.py.

Pure: no torch import, so `python -m app health` and bad-flag errors are fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from app.contract import DATASETS, ROLES, ps_name, worker_name
from app.options import OPTIONS, Option

# The user's own model or dataset (app/common/plugins.py): package.module:factory.
ENTRY_POINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
# A run id names a directory (checkpoints set aside: <checkpoint_dir>/previous/<run id>/).
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
JOB_INDEX_ENV = "JOB_COMPLETION_INDEX"  # a Kubernetes Indexed Job's pod index


class UsageError(Exception):
    """Bad input (flag, model, dataset, data dir, device): one line on stderr, exit 2."""


_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "auto_int": str}


class _ConfigMethods:
    @property
    def num_trainers(self) -> int:
        """How many workers the PS serves."""
        return self.world_size - 1

    @property
    def max_trainers(self) -> int:
        """The highest worker rank the job admits (scaled up while it runs: --max_workers)."""
        return max(self.max_workers, self.world_size - 1)

    @property
    def name(self) -> str:
        """This process's RPC name: `ps`, `ps<shard>` or `worker<rank>`."""
        return ps_name(self.shard) if self.role == "ps" else worker_name(self.rank)


Config = dataclasses.make_dataclass(
    "Config",
    [("role", str)] + [(o.name, _TYPES[o.kind], dataclasses.field(default=o.default)) for o in OPTIONS],
    bases=(_ConfigMethods,),
    frozen=True,
)
Config.__module__ = __name__  # pickles as app.config.Config
Config.__doc__ = "Everything a process of the app needs: its role and one field per option of app/options.py."


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> _Parser:
    parser = _Parser(
        prog="python -m app",
        allow_abbrev=False,
        description="Parameter-Server training over PyTorch RPC. "
        "Every --flag may also be set as PSC_FLAG in the environment.",
    )
    parser.add_argument("role", choices=ROLES)
    for o in OPTIONS:
        metavar = "AUTO|N" if o.kind == "auto_int" else o.kind.upper()
        parser.add_argument(
            o.flag, type=str, default=None, metavar=metavar, help=f"{o.help} (default {o.default!r}, env {o.env})"
        )
    return parser


def parse(argv: Sequence[str], env: Mapping[str, str]) -> Config:
    """Build the Config from argv (role first) and env; raise UsageError on bad input,
    naming what was given: the flag, or the environment variable."""
    args = vars(_parser().parse_args(list(argv)))
    values: dict[str, Any] = {"role": args.pop("role")}
    for o in OPTIONS:
        if args[o.name] is not None:
            values[o.name] = _convert(o, args[o.name], o.flag)
        elif env.get(o.env, "") != "":
            values[o.name] = _convert(o, env[o.env], o.env)
    _job_index(values, env)
    config = Config(**values)
    validate(config)
    return config


def _convert(o: Option, raw: str, source: str) -> Any:
    try:
        return o.convert(raw)
    except ValueError as e:
        raise UsageError(f"{source}: {e}") from None


def _job_index(values: dict[str, Any], env: Mapping[str, str]) -> None:
    """A Kubernetes Indexed Job gives each pod JOB_COMPLETION_INDEX: a worker's rank is the
    index + 1, a PS's shard the index, unless --rank / --shard (or PSC_RANK / PSC_SHARD) say."""
    raw = env.get(JOB_INDEX_ENV, "")
    if raw == "":
        return
    if not raw.isdigit():
        raise UsageError(f"{JOB_INDEX_ENV}: {raw!r} is not a whole number >= 0")
    if values["role"] == "worker" and "rank" not in values:
        values["rank"] = int(raw) + 1
    elif values["role"] == "ps" and "shard" not in values:
        values["shard"] = int(raw)


def validate(config: Config) -> None:
    """Range checks that argparse cannot express; raise UsageError naming the flag."""
    if config.dataset not in DATASETS and not ENTRY_POINT.match(config.dataset):
        raise UsageError(
            f"--dataset: {config.dataset!r} is not one of {', '.join(DATASETS)}, "
            "nor an entry point package.module:factory"
        )
    if ":" in config.model and not ENTRY_POINT.match(config.model):
        raise UsageError(f"--model: {config.model!r} is not an entry point package.module:factory")
    for o in OPTIONS:  # a Config built in code (not parsed) meets the bounds too
        try:
            o.check(getattr(config, o.name))
        except ValueError as e:
            raise UsageError(f"{o.flag}: {e}") from None
    if config.run_id and not RUN_ID.match(config.run_id):
        raise UsageError(
            f"--run_id: {config.run_id!r} must be 1 to 64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if config.shard and (config.role != "ps" or config.shard >= config.shards):
        raise UsageError(
            f"--shard: {config.shard} is for the ps role, in 0..{config.shards - 1} (--shards {config.shards})"
        )
    if config.precision == "fp16" and config.device != "cuda" and config.role == "worker":
        raise UsageError("--precision: fp16 needs --device cuda (loss scaling runs on the GPU); on CPU use bf16")
    if config.shards > 1 and config.strategy == "allreduce":
        raise UsageError(f"--shards: {config.shards} needs a parameter server; strategy allreduce has none")
    if config.overlap and config.strategy in ("sync", "allreduce"):
        raise UsageError(
            f"--overlap: true is for strategies async and ssp; {config.strategy} "
            "waits for every worker's gradient each step"
        )
    if config.role == "check" and not 0 <= config.rank < config.world_size:
        raise UsageError(
            f"--rank: {config.rank} must be in 0..{config.world_size - 1} "
            f"for the check (--world_size {config.world_size})"
        )
    if config.role == "worker" and not 1 <= config.rank <= config.max_trainers:
        scaled = f", --max_workers {config.max_workers}" if config.max_workers else ""
        raise UsageError(
            f"--rank: {config.rank} must be in 1..{config.max_trainers} "
            f"for a worker (--world_size {config.world_size}{scaled})"
        )
    if config.max_workers and config.strategy == "allreduce" and config.max_workers != config.num_trainers:
        raise UsageError(
            f"--max_workers: {config.max_workers} needs a parameter server; allreduce's world size is fixed "
            "(restart from the last checkpoint with the new --world_size)"
        )


def check_threads_env(env: Mapping[str, str]) -> None:
    """OMP_NUM_THREADS, when set, must be one positive integer (torch takes no list)."""
    raw = env.get("OMP_NUM_THREADS", "")
    if raw and not (raw.strip().isdigit() and int(raw) >= 1):
        raise UsageError(f"OMP_NUM_THREADS: {raw!r} is not a positive integer (threads per process)")
