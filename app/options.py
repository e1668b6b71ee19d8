"""Every option of the app, declared once.

One `Option` per flag: its name (the flag `--name`, the environment variable
`PSC_NAME`), its kind, default, allowed values and bounds, its help, and, for a
training option a topology sets, the topology key it comes from and when the
render passes it on. Everything else is read from here:

- the app's argument parser and its `Config` (app/config.py);
- the topology model's fields, their defaults, bounds and descriptions
  (orchestrator/topology/model.py), hence docs/topology.md, generated from it;
- the render's environment (orchestrator/render/compose.py `app_environment`).

Adding a training option is one entry here (and the code that uses it).
`tests/orchestrator/test_options.py` fails when the parser, the topology, the
render and docs/topology.md disagree. The rules between options (`RULES`) are
declared here too, and both the parser and the topology evaluate them. Standard
library only: the orchestrator reads this module on a host without torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from app.contract import (
    COMPRESSIONS,
    DEVICES,
    ENV_PREFIX,
    EXCHANGES,
    IMAGE_CACHES,
    NO_PS_STRATEGY,
    PRECISIONS,
    STRATEGIES,
)

KINDS = ("int", "float", "bool", "str", "auto_int")  # auto_int: `auto` or a whole number >= 0
BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
# Where a process started by hand (no --checkpoint_dir, --metrics_dir, --cache_dir) keeps its
# state: under runs/, which git ignores, never in the tree's own folders (the render and `make
# local` always give the three).
BY_HAND = "./runs/app"
# How the render passes a topology option on: always, or only when it differs from the
# app's default (the app then uses that default: the rendered file stays short).
ALWAYS, CHANGED = "always", "changed"


@dataclass(frozen=True)
class Option:
    name: str
    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    low: Optional[float] = None  # smallest allowed value (`low_open`: excluded)
    low_open: bool = False
    high: Optional[float] = None  # largest allowed value (`high_open`: excluded)
    high_open: bool = False
    topology: str = ""  # "section.key" of the topology file that sets it; "": the render places it, or none
    required: bool = False  # the topology file must give it
    topology_kind: str = ""  # the topology's kind when it differs (a whole number of seconds)
    emit: str = ALWAYS
    bool_aliases: tuple[str, str] = ("", "")  # (false, true) -> these choices (a field that was a boolean)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def section(self) -> str:
        return self.topology.split(".", 1)[0]

    @property
    def key(self) -> str:
        return self.topology.split(".", 1)[1]

    def convert(self, raw: str) -> Any:
        """`raw` (a flag's or a variable's text) as this option's value; ValueError
        saying what is allowed (the caller names where the text came from)."""
        text = raw.strip()
        if self.bool_aliases[0] and text.lower() in BOOLS:
            return self.bool_aliases[int(BOOLS[text.lower()])]
        if self.kind == "auto_int":
            if text.lower() != "auto" and not text.isdigit():
                raise ValueError(f"{raw!r} is not auto or a whole number >= 0")
            return text.lower()
        if self.kind == "bool":
            if text.lower() not in BOOLS:
                raise ValueError(f"{raw!r} is not one of true, false (or 1, 0)")
            return BOOLS[text.lower()]
        kind = {"int": int, "float": float, "str": str}[self.kind]
        try:
            value = kind(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not a valid {self.kind}") from None
        self.check(value)
        return value

    def check(self, value: Any) -> None:
        """ValueError when `value` is outside the choices or bounds."""
        if self.choices and value not in self.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(self.choices)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number")
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            raise ValueError(f"{value} must be {'>' if self.low_open else '>='} {_num(self.low)}")
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            raise ValueError(f"{value} must be {'<' if self.high_open else '<='} {_num(self.high)}")

    def text(self, value: Any) -> str:
        """`value` as the environment carries it (what `convert` reads back)."""
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, float):
            return repr(value)
        return str(value)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _opt(name: str, kind: str, default: Any, help: str, **kw: Any) -> Option:
    return Option(name, kind, default, help, **kw)


# In the order the render writes them into a service's environment.
OPTIONS: tuple[Option, ...] = (
    _opt(
        "rank",
        "int",
        1,
        "worker rank, 1..world_size-1 (the PS is always 0); under Kubernetes, JOB_COMPLETION_INDEX + 1 when unset",
        low=0,
    ),
    _opt("world_size", "int", 3, "PS + workers", low=2),
    _opt(
        "max_workers",
        "int",
        0,
        "the most workers the job may be scaled to while it runs (workers.max): the PS admits ranks up to it, and "
        "each worker takes a fair share of the data of every epoch from the live set; 0: world_size-1",
        low=0,
    ),
    _opt("master_addr", "str", "localhost", "the PS's address"),
    _opt("master_port", "int", 6100, "the PS's rendezvous port", low=1, high=65535),
    _opt("device", "str", "cpu", "cpu or cuda (cuda:0, the one GPU a container sees)", choices=DEVICES),
    _opt(
        "model",
        "str",
        "resnet18",
        "cnn (built in), a torchvision classification model, e.g. resnet18, or your "
        "own as package.module:factory (needs `code`).",
        topology="train.model",
        required=True,
    ),
    _opt(
        "dataset",
        "str",
        "imagefolder",
        "imagefolder, mnist, cifar10 read data_dir; digits and synthetic need "
        "no files; or your own as package.module:factory (needs `code`; it reads data_dir when given).",
        topology="train.dataset",
        required=True,
    ),
    _opt("data_dir", "str", "./imagenette2/val", "data root (unused by digits and synthetic)"),
    _opt("batch_size", "int", 256, "Samples per batch, per worker.", low=1, topology="train.batch_size", required=True),
    _opt(
        "lr",
        "float",
        0.01,
        "SGD learning rate, applied on the PS.",
        low=0,
        low_open=True,
        topology="train.lr",
        required=True,
    ),
    _opt(
        "momentum", "float", 0.0, "SGD momentum, on the PS.", low=0, high=1, high_open=True, topology="train.momentum"
    ),
    _opt(
        "num_epochs",
        "int",
        150,
        "Epochs each worker runs over its shard.",
        low=1,
        topology="train.epochs",
        required=True,
    ),
    _opt(
        "max_steps", "int", 0, "Stop each worker after this many pushes; 0: no cap.", low=0, topology="train.max_steps"
    ),
    _opt(
        "strategy",
        "str",
        "async",
        "async: the PS applies each gradient as it arrives; sync: one averaged "
        "update per round of one gradient from every worker; ssp: async, but no worker gets more than "
        "`staleness` pushes ahead of the slowest; allreduce: no PS, the workers average their gradients with "
        "DistributedDataParallel (docs/strategies.md).",
        choices=STRATEGIES,
        topology="train.strategy",
    ),
    _opt(
        "staleness",
        "int",
        4,
        "ssp only: how many pushes a worker may run ahead of the slowest live worker before it waits.",
        low=0,
        topology="train.staleness",
    ),
    _opt(
        "staleness_lr",
        "bool",
        False,
        "async and ssp: divide each push's learning rate by its staleness (Zhang et al. 2016).",
        topology="train.staleness_lr",
    ),
    _opt(
        "overlap",
        "bool",
        False,
        "async and ssp: compute the next batch while the gradient and the fresh "
        "parameters are on the wire (one more step of staleness).",
        topology="train.overlap",
    ),
    _opt(
        "exchange",
        "str",
        "auto",
        "How pushes and replies cross between a worker and the PS: auto: through shared memory the PS "
        "offers (/dev/shm) when the worker can map it (the same host and /dev/shm: local processes, one "
        "compose project), else over TensorPipe, chosen per worker and logged once; tensorpipe: always "
        "over TensorPipe.",
        choices=EXCHANGES,
    ),
    _opt(
        "partition_values",
        "int",
        1 << 20,
        "Through shared memory, under async with plain SGD and under sync: the PS applies a push in "
        "partitions of at least this many values (cut at parameter boundaries; 4 MiB of float32 by default) "
        "as the worker's backward finishes each, before the push itself arrives.",
        low=1,
    ),
    _opt(
        "shm_dir",
        "str",
        "/dev/shm",
        "Where the PS makes its shared-memory segment for --exchange auto: an absolute path on a tmpfs the "
        "workers share (made there when missing, only inside a tmpfs directory; elsewhere: TensorPipe).",
    ),
    _opt(
        "compress",
        "str",
        "none",
        "Gradients on the wire: none (float32), bf16 or fp16, with error feedback on the worker.",
        choices=COMPRESSIONS,
        topology="train.compress",
    ),
    _opt("seed", "int", 0, "Model init, shuffling and synthetic data.", low=0, topology="train.seed"),
    _opt(
        "eval_every",
        "int",
        100,
        "The PS evaluates on the held-out split every this many updates (and at the end).",
        low=1,
        topology="train.eval_every",
    ),
    _opt("log_every", "int", 10, "A worker prints a line every this many batches.", low=1, topology="train.log_every"),
    _opt(
        "loader_workers",
        "auto_int",
        "auto",
        "DataLoader processes in each container (they pass batches "
        "through /dev/shm: shm_size): a number, or auto: the CPUs the container may use (affinity, cgroup "
        "cpu.max) / the workers on its host, minus 1 for training, at most 8 (2 CPUs and 2 workers: 0). The "
        "PS's evaluation follows the same rule. Each process logs the figure and why.",
        topology="train.loader_workers",
    ),
    _opt(
        "rpc_timeout",
        "float",
        60.0,
        "Seconds for every RPC and every wait, in every process.",
        low=0,
        low_open=True,
        topology="ps.rpc_timeout",
        topology_kind="int",
    ),
    _opt(
        "join_timeout",
        "float",
        300.0,
        "Seconds the PS waits for a missing worker to join or rejoin before it ends without it, "
        "counted while a worker can join (the PS listens and every shard is up); also how long a "
        "worker or PS shard started before its PS waits for it.",
        low=0,
        low_open=True,
        topology="ps.join_timeout",
        topology_kind="int",
    ),
    _opt(
        "checkpoint_every",
        "int",
        1000,
        "The PS saves a checkpoint every this many updates (and at the end, and on SIGTERM); 0: only at the end.",
        low=0,
        topology="ps.checkpoint_every",
    ),
    _opt("checkpoint_dir", "str", f"{BY_HAND}/checkpoints", "the PS writes its checkpoints and final.pt here"),
    _opt("metrics_dir", "str", f"{BY_HAND}/metrics", "JSON lines, one file per process"),
    _opt(
        "shards",
        "int",
        1,
        "PS processes the model's state is split across (services ps, ps-shard1..); helps "
        "when they sit on several hosts or NICs. Every process of the job needs it.",
        low=1,
        high=8,
        topology="ps.shards",
        emit=CHANGED,
    ),
    _opt(
        "image_size",
        "int",
        224,
        "imagefolder: side of the square training crop in pixels; the shorter side "
        "is resized to 8/7 of it first (256 for 224).",
        low=8,
        high=4096,
        topology="train.image_size",
        emit=CHANGED,
    ),
    _opt(
        "host_workers",
        "int",
        1,
        "workers of this job sharing this host's CPUs (--loader_workers auto divides by it)",
        low=1,
    ),
    _opt(
        "image_cache",
        "str",
        "auto",
        "imagefolder: decode each image once into uint8 at 8/7 of image_size "
        "(196 KB an image at 256 px); crop, flip and normalise on the training device. A worker then keeps one "
        "shard of the images for all epochs (shuffled within it each epoch) and holds only that; the PS caches "
        "its held-out set. memory: in /dev/shm (size shm_size for it); file: decoded once into a file on the "
        "state volume keyed by the file list and the size, mapped again by a restarted worker or a later run on "
        "the same data (old files are kept: delete them from the volume); in a job that may be scaled (workers.max "
        "above workers.count) the file holds the whole training split, one file every worker maps, and each "
        "epoch's share follows the workers training; off: decode every image every epoch. "
        "auto (the default): memory when the decoded images take at most half of the container's free "
        "/dev/shm and of its available RAM, else off with one log line saying what to set (processes that share "
        "one /dev/shm choose one at a time, each after the others' reservations); so the fast path is "
        "on wherever it fits, and never makes a container run out of shm. true/false mean memory/off.",
        choices=IMAGE_CACHES,
        topology="train.image_cache",
        emit=CHANGED,
        bool_aliases=("off", "memory"),
    ),
    _opt("cache_dir", "str", f"{BY_HAND}/cache", "--image_cache file: where the decoded shards are kept"),
    _opt("export_dir", "str", f"{BY_HAND}/model", "the export role writes model.pt and model.json here"),
    _opt("init_weights", "str", "", "a state dict file (or a final.pt) the model starts from; empty: none"),
    _opt(
        "precision",
        "str",
        "fp32",
        "Forward/backward under autocast: fp32 (off), bf16 (CPU or GPU) or fp16 "
        "(GPU workers only, with loss scaling). Parameters and pushed gradients stay float32.",
        choices=PRECISIONS,
        topology="train.precision",
        emit=CHANGED,
    ),
    _opt(
        "channels_last",
        "bool",
        False,
        "GPU workers: images (and, under allreduce, the model) in channels-last memory format.",
        topology="train.channels_last",
        emit=CHANGED,
    ),
    _opt(
        "weight_decay",
        "float",
        0.0,
        "SGD weight decay (L2), applied on the PS with the learning rate: each "
        "update adds weight_decay x the parameters to the gradient.",
        low=0,
        topology="train.weight_decay",
        emit=CHANGED,
    ),
    _opt(
        "shard",
        "int",
        0,
        "ps: which shard this process serves; 0 is the main PS at --master_addr; under "
        "Kubernetes, JOB_COMPLETION_INDEX when unset",
        low=0,
    ),
    _opt(
        "run_id",
        "str",
        "",
        "this run's identity, written into every checkpoint: a PS resumes only its own "
        "run's checkpoints (a new run sets older ones aside); empty: resume any",
    ),
    _opt(
        "resume",
        "bool",
        False,
        "a new run continues the newest checkpoint of an unfinished run (another run "
        "id's) instead of starting at version 0",
    ),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def in_topology(section: str) -> list[Option]:
    """The options a topology section sets, in declaration order."""
    return [o for o in OPTIONS if o.topology and o.section == section]


# --- the rules between options ------------------------------------------------------


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


def _workers(v: Mapping[str, Any]) -> int:
    """The number of workers the job starts with (--world_size less the PS)."""
    return int(v["world_size"]) - 1


RULES: tuple[Rule, ...] = (
    Rule(
        "overlap",
        lambda v: bool(v["overlap"]) and v["strategy"] in ("sync", NO_PS_STRATEGY),
        lambda v: (
            f"allowed only with strategy async or ssp ({v['strategy']} waits for every worker's gradient each step)"
        ),
    ),
    Rule(
        "shards",
        lambda v: v["shards"] > 1 and v["strategy"] == NO_PS_STRATEGY,
        lambda v: "allowed only with a parameter server (strategy async, sync or ssp); allreduce has none",
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
        "precision",
        lambda v: v["precision"] == "fp16" and v["device"] != "cuda" and v.get("role") in (None, "worker"),
        lambda v: "needs a GPU, device cuda (loss scaling runs on the GPU); on CPU use bf16",
    ),
)


def broken_rule(values: Mapping[str, Any]) -> Optional[Rule]:
    """The first rule of RULES that `values` break; None when they keep every one."""
    return next((rule for rule in RULES if rule.broken(values)), None)
