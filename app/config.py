"""Command line and PSC_* environment: one frozen Config, flag > env > default.

The options, their kinds, defaults, bounds and help are the fields of app/options.py's dataclasses;
`Config` is all of them at once.

Pure: no torch import, so `python -m app health` and bad-flag errors are fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, Optional

from app.contract import DATASETS, ENTRY_POINT, ROLES, RUN_ID, process_name
from app.option_rules import broken_rule
from app.option_table import BY_NAME, OPTIONS, Option
from app.options import ProcessOptions, PSOptions, TrainOptions

JOB_INDEX_ENV = "JOB_COMPLETION_INDEX"  # a Kubernetes Indexed Job's pod index


class UsageError(Exception):
    """Bad input (flag, model, dataset, data dir, device): one line on stderr, exit 2."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(PSOptions, TrainOptions, ProcessOptions):
    """Everything a process of the app needs: its role and one field per option of app/options.py."""

    role: str

    @property
    def num_trainers(self) -> int:
        """How many workers the PS serves."""
        return self.world_size - 1

    @property
    def max_trainers(self) -> int:
        """The highest worker rank the job admits (scaled up while it runs: --max_workers)."""
        return max(self.max_workers, self.world_size - 1)

    @property
    def held_out_batch(self) -> int:
        """The held-out evaluation's batch size: --eval_batch_size, else --batch_size."""
        return self.eval_batch_size or self.batch_size

    @property
    def name(self) -> str:
        """This process's RPC name: `ps`, `ps<shard>` or `worker<rank>`."""
        return process_name(self.role, self.rank, self.shard)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> _Parser:
    parser = _Parser(
        prog="python -m app",
        allow_abbrev=False,
        description="Parameter-Server training over the job's own authenticated transport. "
        "Every --flag may also be set as PSC_FLAG in the environment.",
    )
    parser.add_argument("role", choices=ROLES)
    for o in OPTIONS:
        metavar = {"auto_int": "AUTO|N", "spec": "NAME|JSON"}.get(o.kind, o.kind.upper())
        parser.add_argument(
            o.flag,
            dest=o.name,
            type=str,
            default=None,
            metavar=metavar,
            help=f"{o.help} (default {o.default!r}, env {o.env})",
        )
    return parser


def parse(argv: Sequence[str], env: Mapping[str, str]) -> Config:
    """Build the Config from argv (role first) and env; raise UsageError on bad input,
    naming what was given: the flag, or the environment variable."""
    args = vars(_parser().parse_args(list(argv)))
    values: dict[str, Any] = {"role": args.pop("role")}
    sources: dict[str, str] = {}
    for o in OPTIONS:
        if args[o.name] is not None:
            values[o.name], sources[o.name] = _convert(o, args[o.name], o.flag), o.flag
        elif env.get(o.env, "") != "":
            values[o.name], sources[o.name] = _convert(o, env[o.env], o.env), o.env
    _job_index(values, sources, env)
    config = Config(**values)
    validate(config, sources)
    return config


def _convert(o: Option, raw: str, source: str) -> Any:
    try:
        return o.convert(raw)
    except ValueError as e:
        raise UsageError(f"{source}: {e}") from None


def _job_index(values: dict[str, Any], sources: dict[str, str], env: Mapping[str, str]) -> None:
    """A Kubernetes Indexed Job gives each pod JOB_COMPLETION_INDEX: a worker's rank is the
    index + 1, a PS's shard the index, unless --rank / --shard (or PSC_RANK / PSC_SHARD) say."""
    raw = env.get(JOB_INDEX_ENV, "")
    if raw == "":
        return
    if not raw.isdigit():
        raise UsageError(f"{JOB_INDEX_ENV}: {raw!r} is not a whole number >= 0")
    if values["role"] == "worker" and "rank" not in values:
        values["rank"], sources["rank"] = int(raw) + 1, JOB_INDEX_ENV
    elif values["role"] == "ps" and "shard" not in values:
        values["shard"], sources["shard"] = int(raw), JOB_INDEX_ENV


def validate(config: Config, sources: Optional[Mapping[str, str]] = None) -> None:
    """The checks argparse cannot express; UsageError naming the option as it was given
    (`sources`: each given option's flag or variable; None: a Config built in code, where
    every value other than its option's default counts as given, under its flag)."""
    if sources is None:
        sources = {o.name: o.flag for o in OPTIONS if getattr(config, o.name) != o.default}
    _check_names(config)
    for o in OPTIONS:  # a Config built in code (not parsed) meets the bounds too
        try:
            o.check(getattr(config, o.name))
        except ValueError as e:
            raise UsageError(f"{sources.get(o.name, o.flag)}: {e}") from None
    values = {**dataclasses.asdict(config), "given": frozenset(sources)}
    rule = broken_rule(values)
    if rule is not None:
        o = BY_NAME[rule.option]
        where = sources.get(o.name, o.flag)
        raise UsageError(f"{where}: got {o.text(getattr(config, o.name))}; {rule.allowed(values)}")
    _check_ranks(config, sources)
    if "lr" in sources and "lr" in config.optimizer:
        raise UsageError(
            f"{sources['lr']}: got {config.lr}; the optimizer gives its own lr ({config.optimizer['lr']}): "
            "give the rate once"
        )
    if not os.path.isabs(config.shm_dir):  # handed to workers as it is: one directory for all
        raise UsageError(
            f"{sources.get('shm_dir', '--shm_dir')}: {config.shm_dir!r} is not an absolute path; "
            "give the tmpfs directory the PS and its workers share (/dev/shm by default)"
        )


def _check_names(config: Config) -> None:
    """The dataset, a model entry point and the run id name what they may."""
    if config.dataset not in DATASETS and not ENTRY_POINT.match(config.dataset):
        raise UsageError(
            f"--dataset: {config.dataset!r} is not one of {', '.join(DATASETS)}, "
            "nor an entry point package.module:factory"
        )
    if ":" in config.model and not ENTRY_POINT.match(config.model):
        raise UsageError(f"--model: {config.model!r} is not an entry point package.module:factory")
    if config.run_id and not RUN_ID.match(config.run_id):
        raise UsageError(
            f"--run_id: {config.run_id!r} must be 1 to 64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


def _check_ranks(config: Config, sources: Mapping[str, str]) -> None:
    """A process's rank and shard fit its role and the job's size."""
    rank = sources.get("rank", "--rank")
    if config.role == "ps" and "rank" in sources and config.rank != 0:
        raise UsageError(f"{rank}: got {config.rank}; the ps role is rank 0 (leave it out, or 0)")
    if config.shard and (config.role != "ps" or config.shard >= config.shards):
        raise UsageError(
            f"{sources.get('shard', '--shard')}: {config.shard} is for the ps role, in 0..{config.shards - 1} "
            f"(--shards {config.shards})"
        )
    if config.role == "check" and not 0 <= config.rank < config.world_size:
        raise UsageError(
            f"{rank}: {config.rank} must be in 0..{config.world_size - 1} "
            f"for the check (--world_size {config.world_size})"
        )
    if config.role == "worker" and not 1 <= config.rank <= config.max_trainers:
        scaled = f", --max_workers {config.max_workers}" if config.max_workers else ""
        raise UsageError(
            f"{rank}: {config.rank} must be in 1..{config.max_trainers} "
            f"for a worker (--world_size {config.world_size}{scaled})"
        )


def check_threads_env(env: Mapping[str, str]) -> None:
    """OMP_NUM_THREADS, when set, must be one positive integer (torch takes no list)."""
    raw = env.get("OMP_NUM_THREADS", "")
    if raw and not (raw.strip().isdigit() and int(raw) >= 1):
        raise UsageError(f"OMP_NUM_THREADS: {raw!r} is not a positive integer (threads per process)")
