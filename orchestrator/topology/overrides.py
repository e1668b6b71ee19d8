"""Overrides on the command line, Hydra's way: `train.lr=0.05 workers.count=3`.

Each is a dotted key of the topology and a value read as YAML's flow syntax, typed as Hydra
types it (yaml_text.load_override: `0.05` a float, `010` the integer 10, `yes` and `1:30`
strings, `[0, 1]` a list, `null` none); `+key=value` and
`++key=value` (Hydra's add and force) set the key as `key=value` does, and `~key` removes it.
They are applied to the file's mapping, which is then validated exactly as a file is: a bad
value is one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import yaml

from orchestrator.errors import UsageError, one_line
from orchestrator.topology import yaml_text
from orchestrator.topology.messages import TopologyError

T = TypeVar("T")

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*")
RULE = "must be KEY=VALUE with a dotted KEY (train.lr=0.05), or ~KEY to remove one"


@dataclass(frozen=True)
class Override:
    text: str  # as typed
    key: str  # dotted
    value: Any = None
    remove: bool = False

    @property
    def parts(self) -> list[str]:
        return self.key.split(".")


def looks_like_override(text: str) -> bool:
    """An argument that is an override (`key=value` or `~key`), not a verb's operand."""
    return "=" in text or text.startswith("~")


def parse(text: str) -> Override:
    """`text` as an override; UsageError (one line) when it is not one."""
    if text.startswith("~"):
        key = text[1:]
        if "=" in key or not _KEY.fullmatch(key):
            raise UsageError(f"override {text!r}: {RULE}")
        return Override(text, key, remove=True)
    key, sep, raw = text.partition("=")
    plus = len(key) - len(key.lstrip("+"))  # Hydra's +key (add) and ++key (add or override)
    key = key[plus:]
    if not sep or plus > 2 or not _KEY.fullmatch(key):
        raise UsageError(f"override {text!r}: {RULE}")
    try:
        value = yaml_text.load_override(raw) if raw.strip() else ""
    except (yaml.YAMLError, yaml_text.LimitError) as e:
        what = getattr(e, "problem", None) or one_line(e)
        raise UsageError(f"override {text!r}: {key}: got {raw!r}; must be a YAML value ({what})") from None
    return Override(text, key, value)


def apply(data: dict, overrides: list[Override]) -> dict:
    """A copy of the file's mapping `data` with `overrides` applied in order (the last of one key
    wins); UsageError when a key goes through a value that is not a mapping."""
    out = copy.deepcopy(data)
    for o in overrides:
        node = out
        for i, part in enumerate(o.parts[:-1]):
            child = node.get(part)
            if child is None and not o.remove:
                child = node[part] = {}
            if not isinstance(child, dict):
                if child is None:  # ~a.b where a is absent: nothing to remove
                    break
                where = ".".join(o.parts[: i + 1])
                raise UsageError(f"override {o.text!r}: {where}: got {child!r}; must be a mapping to set {o.key} in")
            node = child
        else:
            if o.remove:
                node.pop(o.parts[-1], None)
            else:
                node[o.parts[-1]] = o.value
    return out


def describe(overrides: list[Override]) -> str:
    """The overrides as one argument string (the rendered file's header, the run's record)."""
    return " ".join(o.text if " " not in o.text else repr(o.text) for o in overrides)


def blame(overrides: list[Override], path: str) -> Optional[Override]:
    """The override of the field `path` (or of a section above it, or a key below it)."""
    for o in reversed(overrides):
        if path == o.key or path.startswith(o.key + ".") or o.key.startswith(path + "."):
            return o
    return None


def validated(data: dict, source: str, given: list[Override], validate: Callable[[dict, str], T]) -> T:
    """`validate(data, ...)` of the file's mapping with `given` applied; its error names the file
    with the override of the field at fault (else with them all)."""
    try:
        return validate(data, source)
    except TopologyError as e:
        o = blame(given, e.path)
        raise TopologyError(f"{source} with {o.text if o else describe(given)}", e.path, e.problem) from None
