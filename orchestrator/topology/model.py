"""The typed topology: one pydantic model per section of configs/*.yaml.

`load(path)` reads, parses and validates a file; `Topology.with_workers(n)`
and `Topology.with_strategy(name)` apply the `--workers` and `--strategy`
overrides (`load_with` does all three). Every problem raises one `TopologyError`
whose message is a single line: the file, the YAML path of the field, the
value found and what is allowed, e.g.

    configs/x.yaml: workers.gpus: got [0, 0]; GPU ids must be distinct (one GPU per worker)

Here: the Topology with what it derives, the rules between fields, and reading a file. The
train and ps sections (app/options.py's `TrainOptions` and `PSOptions`, as a topology
holds them) are in option_sections.py, the other sections in fields.py, the kinds of value
fields take in values.py, pydantic's error as one line in messages.py.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from app.contract import (
    DATA_URL_SCHEMES,
    FILE_DATASETS,
    S3_ENV,
    SHARD_DATASETS,
    STRATEGIES,
    StrategyName,
    strategy_of,
    url_scheme,
)
from app.option_rules import broken_rule
from app.option_table import BY_NAME, OPTIONS, in_topology
from orchestrator.errors import one_line
from orchestrator.paths import config_file
from orchestrator.topology import overrides as override
from orchestrator.topology import yaml_text
from orchestrator.topology.fields import (
    MAX_WORKERS,
    SHARED_TYPES,
    Image,
    Kubernetes,
    Network,
    State,
    Swarm,
    Tracking,
    Workers,
    default_image,
    env_name_problem,
)
from orchestrator.topology.messages import TopologyError, check_required, first_error, keys, show, yaml_type
from orchestrator.topology.option_sections import PS, Train
from orchestrator.topology.values import size_bytes

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,49}")  # fullmatch: one line, no trailing newline
NAME_RULE = "must be lowercase letters, digits, '-' or '_', starting with a letter or digit, at most 50 characters"


class Topology(BaseModel):
    # Not strict as a whole: pydantic's strict mode takes a dataclass section (train, ps) only as
    # an instance; each section is strict on its own values.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    _overrides: tuple[str, ...] = PrivateAttr(default=())

    name: str
    """Names the compose project, the image and runs/<name>/; lowercase letters, digits, '-', '_'."""
    image: Image = Field(default_factory=lambda: default_image())
    train: Train
    ps: PS = Field(default_factory=PS)
    workers: Workers
    network: Network = Field(default_factory=Network)
    swarm: Swarm = Field(default_factory=Swarm)
    state: State = Field(default_factory=State)
    kubernetes: Kubernetes = Field(default_factory=Kubernetes)
    tracking: Tracking = Field(default_factory=Tracking)
    code: Optional[str] = Field(default=None, min_length=1)
    """Host directory of your own Python code (train.model/dataset as package.module:factory); relative: like
    train.data_dir. Mounted read-only at /code, on PYTHONPATH."""
    env: list[str] = Field(default_factory=list)
    """Names of variables of the caller's environment (HF_TOKEN, a bucket's credentials) that the PS and every
    worker get: compose, a stack and `local` take each value from the environment of the command (a name it has
    not set stays unset, with a warning); the rendered files hold the names only, never a value. Kubernetes
    takes them from the Secret <name>-env (optional keys)."""

    @field_validator("env")
    @classmethod
    def _env(cls, v: list[str]) -> list[str]:
        for name in v:
            problem = env_name_problem(name)
            if problem:
                raise ValueError(f"{name!r}: {problem}")
        if len(set(v)) != len(v):
            raise ValueError("a name is given twice")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not valid_name(v):
            raise ValueError(NAME_RULE)
        return v

    def env_unset(self, environ: Any) -> Optional[str]:
        """One line naming the variables of `env` that `environ` (the caller's) has not set: the
        job's processes will not have them; None when every one is set."""
        missing = [name for name in self.env if name not in environ]
        if not missing:
            return None
        them = "it" if len(missing) == 1 else "them"
        return f"env: {', '.join(missing)} not set here: the job's processes will not have {them}"

    @property
    def world_size(self) -> int:
        return self.workers.count + 1

    @property
    def image_tag(self) -> str:
        return self.image.tag or f"ps-compose-{self.name}:latest"

    @property
    def cuda(self) -> bool:
        return self.image.device == "cuda"

    @property
    def reads_files(self) -> bool:
        """True when the dataset is read from train.data_dir (your own dataset: when one is given)."""
        return self.train.dataset in FILE_DATASETS or (
            is_entry_point(self.train.dataset) and self.train.data_dir is not None
        )

    def data_source(self) -> Optional[str]:
        """The host directory the render mounts at /data: train.data_dir, or the folder of its pattern
        for shards (webdataset); None when nothing is mounted (no files read, or a URL: read as given)."""
        if not self.reads_files or url_scheme(self.data_dir()) is not None:
            return None
        return _folder(self.data_dir()) if self.train.dataset in SHARD_DATASETS else self.data_dir()

    def data_for(self, mounted_at: str) -> str:
        """train.data_dir as the job's processes get it: a URL as given, a path where its source
        (`data_source`) is mounted at `mounted_at`."""
        return _as_mounted(self.data_dir(), mounted_at, self.train.dataset in SHARD_DATASETS)

    def eval_source(self) -> Optional[str]:
        """The folder of train.eval_data's pattern, mounted beside the data; None for a URL or none."""
        given = self.train.eval_data
        return _folder(given) if given and url_scheme(given) is None else None

    def eval_for(self, mounted_at: str) -> str:
        """train.eval_data as the job's processes get it (as `data_for`)."""
        return _as_mounted(self.train.eval_data, mounted_at, True)

    def job_env(self) -> list[str]:
        """The variables every process gets by name from the caller: `env`, and the AWS ones where
        the data is on s3:// (S3_ENV); never their values."""
        paths = [self.train.data_dir or "", self.train.eval_data] if self.reads_files else []
        s3 = [name for name in S3_ENV if any(url_scheme(p) == "s3" for p in paths)]
        return list(dict.fromkeys([*self.env, *s3]))

    def entry_points(self) -> list[tuple[str, str]]:
        """(YAML path, value) of train.model, train.dataset, the optimizer, the loss and the
        metrics when they name the user's code."""
        tr = self.train
        fields = (
            ("train.model", tr.model),
            ("train.dataset", tr.dataset),
            ("train.optimizer.name", tr.optimizer["name"]),
            ("train.loss.name", tr.loss["name"]),
            ("train.metrics", tr.metrics),
        )
        return [(path, v) for path, v in fields if is_entry_point(v)]

    @property
    def max_workers(self) -> int:
        """The most workers the job may be scaled to while it runs (workers.max, default count)."""
        return self.workers.max if self.workers.max is not None else self.workers.count

    def worker_gpus(self) -> list[int]:
        """The GPU id of each possible worker (ranks 1..max_workers), in rank order; empty on CPU."""
        if not self.cuda:
            return []
        gpus = self.workers.gpus if self.workers.gpus is not None else list(range(self.max_workers))
        return gpus[: self.max_workers]

    def data_dir(self) -> str:
        """train.data_dir, which `check` requires of a dataset that reads files (ask only then)."""
        if self.train.data_dir is None:
            raise TopologyError("<topology>", "train.data_dir", f"missing for dataset {self.train.dataset!r}")
        return self.train.data_dir

    def ps_gpu(self) -> Optional[int]:
        return self.ps.gpu if self.cuda else None

    def worker_nodes(self) -> list[Optional[str]]:
        """Swarm placement of each worker, in rank order (None: any node)."""
        w = self.swarm.workers
        if w is None or len(w) == 1:
            return [w[0] if w else None] * self.workers.count
        return list(w[: self.workers.count])

    def spans_nodes(self) -> bool:
        """The topology itself places services on more than one node (distinct swarm.ps /
        swarm.workers entries); False when it cannot tell (no placement, or one entry)."""
        named = {n for n in [self.swarm.ps, *(self.swarm.workers or [])] if n is not None}
        return len(named) > 1

    def with_workers(self, count: int, source: str = "--workers") -> Topology:
        """The same topology with `count` workers (GPUs 0..count-1 unless listed)."""
        if not 1 <= count <= MAX_WORKERS:
            raise TopologyError(source, "workers.count", f"got {count}; must be from 1 to {MAX_WORKERS}")
        t = self.model_copy(update={"workers": self.workers.model_copy(update={"count": count})})
        check(t, source)
        return t

    def with_name(self, name: str, source: str = "--name") -> Topology:
        """The same job under another `name` (`--name`, `make ... NAME=`): its compose project or
        stack, its state volume and runs/<name>/; the image stays the topology's own."""
        if not valid_name(name):
            raise TopologyError(source, "name", f"got {name!r}; {NAME_RULE}")
        image = self.image.model_copy(update={"tag": self.image_tag})
        return self.model_copy(update={"name": name, "image": image})

    def with_strategy(self, name: str, source: str = "--strategy") -> Topology:
        """The same topology trained with strategy `name` (`--strategy`), validated again."""
        if name not in STRATEGIES:
            raise TopologyError(source, "train.strategy", f"got {name!r}; must be one of {', '.join(STRATEGIES)}")
        t = self.model_copy(update={"train": dataclasses.replace(self.train, strategy=cast(StrategyName, name))})
        check(t, source)
        return t

    @property
    def overrides(self) -> tuple[str, ...]:
        """The command line's KEY=VALUE overrides this topology was loaded with, as typed."""
        return self._overrides


def _folder(pattern: str) -> str:
    """The folder a shard pattern's files are in (`.` for a bare name)."""
    return posixpath.dirname(pattern) or "."


def _as_mounted(path: str, mounted_at: str, pattern: bool) -> str:
    """`path` as a process sees it where its folder (a pattern's) or itself is at `mounted_at`; a URL as given."""
    if not path or url_scheme(path) is not None:
        return path
    return posixpath.join(mounted_at, posixpath.basename(path)) if pattern else mounted_at


def valid_name(name: str) -> bool:
    """What the topology's `name` (and `--name`) allows: NAME_RULE, on one line."""
    return _NAME.fullmatch(name) is not None


def is_entry_point(value: str) -> bool:
    """`package.module:factory` (the user's code) rather than a built-in name."""
    return ":" in value


def check(t: Topology, source: str) -> None:
    """The checks that span fields (pydantic has checked each field); the first problem raises."""
    for part in (
        _check_inputs,
        _check_recipe,
        _check_rules,
        _check_gpus,
        _check_state,
        _check_placement,
        _check_tracking,
    ):
        part(t, source)


def _check_inputs(t: Topology, source: str) -> None:
    """What the job reads: the user's code for an entry point, a data_dir for a file dataset."""
    for path, value in t.entry_points():
        if t.code is None:
            raise TopologyError(
                source,
                path,
                f"got {value!r}; an entry point needs the top-level `code` (the directory of your Python code)",
            )
    if t.reads_files and t.train.data_dir is None:
        raise TopologyError(
            source,
            "train.data_dir",
            f"missing; required for dataset {t.train.dataset!r} (the host directory of the data)",
        )
    for key in ("data_dir", "eval_data"):
        value = getattr(t.train, key) or ""
        scheme = url_scheme(value)
        if scheme is not None and scheme not in DATA_URL_SCHEMES:
            schemes = ", ".join(f"{s}://" for s in DATA_URL_SCHEMES)
            raise TopologyError(
                source, f"train.{key}", f"got {value!r}; a URL's scheme must be {schemes}, not {scheme}://"
            )
        if scheme is not None and key == "data_dir" and t.train.dataset in FILE_DATASETS - SHARD_DATASETS:
            raise TopologyError(
                source,
                "train.data_dir",
                f"got {value!r}; dataset {t.train.dataset} reads a local directory (a URL: webdataset or your own)",
            )


def _check_recipe(t: Topology, source: str) -> None:
    """The optimizer, the schedule, the loss and the metrics: each name and key (app/recipes.py)."""
    for o in in_topology("train"):
        problem = o.problem(getattr(t.train, o.key))
        if problem is not None:
            path = f"{o.topology}.{problem.key}" if problem.key else o.topology
            raise TopologyError(source, path, problem.text)


def _check_gpus(t: Topology, source: str) -> None:
    gpus = t.workers.gpus
    if gpus is not None and len(set(gpus)) != len(gpus):
        raise TopologyError(source, "workers.gpus", f"got {gpus}; GPU ids must be distinct (one GPU per worker)")
    if t.cuda and gpus is not None and len(gpus) < t.max_workers:
        raise TopologyError(
            source,
            "workers.gpus",
            f"got {gpus} for {t.max_workers} workers; must list one GPU id per worker "
            f"(or leave it out for 0..{t.max_workers - 1})",
        )
    if t.image.group_add and not t.cuda:
        raise TopologyError(
            source,
            "image.group_add",
            f"got {list(t.image.group_add)}; allowed only with image.device cuda (it is for the GPU device nodes)",
        )


def _check_state(t: Topology, source: str) -> None:
    opts = t.state.driver_opts
    if opts and t.state.volume_driver is None:
        raise TopologyError(
            source,
            "state.driver_opts",
            f"got {show(dict(opts))}; allowed only with state.volume_driver (e.g. local, with type: nfs)",
        )
    if opts.get("type") in SHARED_TYPES and not (opts.get("device") and "addr=" in opts.get("o", "")):
        raise TopologyError(
            source,
            "state.driver_opts",
            f"got {show(dict(opts))}; type {opts['type']} needs "
            "device (the export, e.g. ':/exports/psc') and o with addr=SERVER (e.g. 'addr=10.0.0.5,rw')",
        )


def _check_tracking(t: Topology, source: str) -> None:
    if t.tracking.mlflow and not strategy_of(t.train.strategy).has_ps:
        raise TopologyError(
            source,
            "tracking.mlflow",
            f"got true; the PS logs the run to MLflow, and strategy {t.train.strategy} has none: "
            "allowed only with a strategy that has a PS (async, ssp, sync)",
        )


def _check_placement(t: Topology, source: str) -> None:
    """Swarm's nodes for the workers; a Kubernetes pod's memory above its /dev/shm."""
    nodes = t.swarm.workers
    if nodes is not None and 1 < len(nodes) < t.workers.count:
        raise TopologyError(
            source,
            "swarm.workers",
            f"got {nodes} for {t.workers.count} workers; must list one node per worker, or a single node for all",
        )
    for key, memory, shm_key, shm in (
        ("ps_memory", t.kubernetes.ps_memory, "ps.shm_size", t.ps.shm_size),
        ("worker_memory", t.kubernetes.worker_memory, "workers.shm_size", t.workers.shm_size),
    ):
        if memory is not None and size_bytes(memory) <= size_bytes(shm):
            raise TopologyError(
                source,
                f"kubernetes.{key}",
                f"got {show(memory)}; must be more than {shm_key} ({shm}): the pod's /dev/shm is memory it is "
                "charged for",
            )


# The topology's own place for the options of the rules that no topology key sets.
_RULE_PATHS = {"max_workers": "workers.max", "device": "image.device", "world_size": "workers.count"}


def rule_values(t: Topology) -> dict[str, Any]:
    """The job's values as the rules between options (app/option_rules.py RULES) read them."""
    values: dict[str, Any] = {o.name: getattr(getattr(t, o.section), o.key) for o in OPTIONS if o.topology}
    values.update(
        max_workers=t.workers.max,
        world_size=t.workers.count + 1,
        device=t.image.device,
        role=None,
        given=frozenset(o.name for o in OPTIONS if o.topology) | ({"max_workers"} if t.workers.max else set()),
    )
    return values


def _check_rules(t: Topology, source: str) -> None:
    """The rules between options that the app's parser evaluates too, named by their YAML path."""
    values = rule_values(t)
    rule = broken_rule(values)
    if rule is not None:
        o = BY_NAME[rule.option]
        path = o.topology or _RULE_PATHS[o.name]
        raise TopologyError(source, path, f"got {show(values[o.name])}; {rule.allowed(values)}")


def load(path: str | Path, overrides: Sequence[str] = ()) -> Topology:
    """Read, parse and validate a topology file, with the command line's `overrides` applied."""
    source = str(path)
    try:
        text = config_file(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TopologyError(source, "", "no such file") from None
    except IsADirectoryError:
        raise TopologyError(source, "", "is a directory, not a topology file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TopologyError(source, "", f"cannot read: {one_line(e)}") from None
    return parse(text, source, overrides)


def load_with(
    path: str | Path,
    *,
    workers: Optional[int] = None,
    strategy: Optional[str] = None,
    name: Optional[str] = None,
    overrides: Sequence[str] = (),
) -> Topology:
    """`load(path, overrides)` with the `--workers`, `--strategy` and `--name` overrides applied
    (None: as in the file); an error names the file and the flag."""
    t = load(path, overrides)
    if name is not None:
        t = t.with_name(name, source=f"{path} with --name")
    if workers is not None:
        t = t.with_workers(workers, source=f"{path} with --workers {workers}")
    if strategy is not None:
        t = t.with_strategy(strategy, source=f"{path} with --strategy {strategy}")
    return t


def parse(text: str, source: str = "<topology>", overrides: Sequence[str] = ()) -> Topology:
    """Validate a topology given as YAML text (`source` names it in errors), with `overrides`
    (`train.lr=0.05`: orchestrator/topology/overrides.py) applied to its mapping first."""
    try:
        data = yaml_text.load(text)
    except yaml_text.LimitError as e:
        raise TopologyError(source, "", f"not a topology: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = getattr(e, "problem", None) or one_line(e)
        raise TopologyError(source, "", f"not valid YAML: {where}{what}") from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {yaml_type(data)}"
        raise TopologyError(source, "", f"got {got}; must be a mapping with keys {keys(Topology)}")
    if not overrides:
        return validate(data, source)
    given = [override.parse(o) for o in overrides]
    t = override.validated(override.apply(data, given), source, given, validate)
    t._overrides = tuple(o.text for o in given)
    return t


def validate(data: dict, source: str) -> Topology:
    """The topology of a file's mapping, validated (TopologyError: one line)."""
    try:
        t = Topology.model_validate(data)
    except ValidationError as e:
        raise first_error(e, source, Topology, data) from None
    check_required(data, source)
    check(t, source)
    return t
