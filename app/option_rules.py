"""The rules between options (app/options.py): each a condition on the job's values that
breaks it, the option at fault and what is allowed, in words. The app's parser
(app/config.py `validate`) and the topology (orchestrator/topology/model.py `check`) evaluate
the same RULES, each naming the option its own way. Standard library only, as app/options.py:
the orchestrator reads this module on a host without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from app.contract import ENTRY_POINT, NO_PS_STRATEGY, SHARD_DATASETS, strategy_of
from app.recipes import resolve_optimizer


@dataclass(frozen=True)
class Rule:
    """A rule between options, evaluated by the app's parser (app/config.py `validate`) and by
    the topology (orchestrator/topology/model.py `check`), each on its own values and naming the
    option its own way (the flag or variable it came from; its YAML path).

    `broken(v)`: the job's values `v`, by option name (`given`: the names of the options set
    rather than left to their defaults; `role`: the process's, None for a whole job), break
    it; `option`: the one at fault; `allowed(v)`: what is allowed, in words."""

    option: str
    broken: Callable[[Mapping[str, Any]], bool]
    allowed: Callable[[Mapping[str, Any]], str]


def _optimizer_clash(v: Mapping[str, Any], key: str) -> Optional[str]:
    """train.momentum or train.weight_decay (`key`) that the optimizer has no use for, or gives too."""
    given = {"momentum": 0.0, "weight_decay": 0.0, key: v[key]}
    try:
        resolve_optimizer(v["optimizer"], v["lr"], given["momentum"], given["weight_decay"])
    except ValueError as e:
        return str(e)
    return None


def _local(v: Mapping[str, Any]) -> bool:
    """A strategy of local steps (diloco, diloco_async)."""
    return strategy_of(v["strategy"]).local


def _ps_schedule(v: Mapping[str, Any]) -> bool:
    """A schedule only the PS steps: plateau (its evaluations) or the user's own."""
    return v["schedule"]["name"] == "plateau" or ENTRY_POINT.match(v["schedule"]["name"]) is not None


def _workers(v: Mapping[str, Any]) -> int:
    """The number of workers the job starts with (--world_size less the PS)."""
    return int(v["world_size"]) - 1


RULES: tuple[Rule, ...] = (
    Rule(
        "overlap",
        lambda v: bool(v["overlap"]) and not strategy_of(v["strategy"]).allows_overlap,
        lambda v: (
            f"allowed only with strategy async or ssp ({v['strategy']} "
            + (
                "pushes once every local_steps batches)"
                if _local(v)
                else "waits for every worker's gradient each step)"
            )
        ),
    ),
    Rule(
        "staleness_lr",
        lambda v: bool(v["staleness_lr"]) and _local(v),
        lambda v: f"allowed only with strategy async or ssp ({v['strategy']}'s outer optimizer takes each change)",
    ),
    Rule(
        "schedule",
        lambda v: _local(v) and _ps_schedule(v),
        lambda v: (
            f"under {v['strategy']} the schedule steps each worker's own optimizer by its steps: constant, cosine, "
            "step or linear (plateau and your own are stepped by the PS)"
        ),
    ),
    Rule(
        "cuda_graphs",
        lambda v: bool(v["cuda_graphs"]) and _local(v),
        lambda v: f"not with strategy {v['strategy']} (its own optimizer steps between the graph's replays)",
    ),
    Rule(
        "shards",
        lambda v: v["shards"] > 1 and v["strategy"] == NO_PS_STRATEGY,
        lambda v: "allowed only with a parameter server; allreduce has none",
    ),
    Rule(
        "max_workers",
        lambda v: "max_workers" in v["given"] and v["max_workers"] < _workers(v),
        lambda v: f"must be at least the number of workers ({_workers(v)}), or left out",
    ),
    Rule(
        "max_workers",
        lambda v: "max_workers" in v["given"] and v["max_workers"] > _workers(v) and v["strategy"] == NO_PS_STRATEGY,
        lambda v: (
            f"strategy allreduce has a fixed world size (leave it out, or equal to the number of workers, "
            f"{_workers(v)})"
        ),
    ),
    Rule(
        "momentum",
        lambda v: _optimizer_clash(v, "momentum") is not None,
        lambda v: str(_optimizer_clash(v, "momentum")),
    ),
    Rule(
        "weight_decay",
        lambda v: _optimizer_clash(v, "weight_decay") is not None,
        lambda v: str(_optimizer_clash(v, "weight_decay")),
    ),
    Rule(
        "optimizer",
        lambda v: v["optimizer"]["name"] == "adafactor" and v["shards"] > 1,
        lambda v: (
            "adafactor factors each weight matrix by its rows and columns, and a PS shard steps pieces "
            "of them: allowed with one PS process (ps.shards 1)"
        ),
    ),
    Rule(
        "schedule",
        lambda v: v["schedule"]["name"] == "plateau" and (v["shards"] > 1 or v["strategy"] == NO_PS_STRATEGY),
        lambda v: (
            "plateau follows the main PS's evaluations: allowed with one PS process (ps.shards 1) and a "
            "parameter server (any strategy but allreduce)"
        ),
    ),
    Rule(
        "schedule",
        lambda v: ENTRY_POINT.match(v["schedule"]["name"]) is not None and v["strategy"] == NO_PS_STRATEGY,
        lambda v: (
            "your own schedule is stepped by the PS: allowed with a parameter server (any strategy but allreduce)"
        ),
    ),
    Rule(
        "dataset",
        lambda v: v["dataset"] in SHARD_DATASETS and not v["eval_data"],
        lambda v: "needs eval_data too: the held-out shards' pattern, a URL or a path as data_dir's",
    ),
    Rule(
        "max_steps",
        lambda v: v["dataset"] in SHARD_DATASETS and not v["max_steps"],
        lambda v: (
            f"dataset {v['dataset']} is a stream of shards with no declared length: give max_steps, "
            "each worker's pushes (>= 1), which plan the run"
        ),
    ),
    Rule(
        "precision",
        lambda v: v["precision"] == "fp16" and v["device"] != "cuda" and v.get("role") in (None, "worker"),
        lambda v: "needs a GPU, device cuda (loss scaling runs on the GPU); on CPU use bf16",
    ),
    Rule(
        "cuda_graphs",
        lambda v: bool(v["cuda_graphs"]) and v["precision"] == "fp16",
        lambda v: "not with precision fp16 (the loss scale and its overflow check are host decisions each step)",
    ),
    Rule(
        "cuda_graphs",
        lambda v: bool(v["cuda_graphs"]) and v["strategy"] == NO_PS_STRATEGY,
        lambda v: "allowed only with a parameter server (any strategy but allreduce): DDP's hooks run in the step",
    ),
)


def broken_rule(values: Mapping[str, Any]) -> Optional[Rule]:
    """The first rule of RULES that `values` break; None when they keep every one."""
    return next((rule for rule in RULES if rule.broken(values)), None)
