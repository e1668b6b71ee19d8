"""A topology's YAML text read within limits: its size, its nesting and what its aliases expand
to are checked on the parser's event stream (which neither recurses nor expands an alias)
before anything is built, so a hostile file costs milliseconds and a one-line error, not
minutes, gigabytes or a RecursionError. Keys are strings, numbers or booleans, each once per
mapping."""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # a topology is a page or two; this is a thousand times that
MAX_DEPTH = 32  # sections nest 3 deep (train.optimizer.betas); the rest is headroom
MAX_VALUES = 10_000  # scalars, lists and mappings, each alias counted as what it stands for


class LimitError(ValueError):
    """The text is past a limit: `where` is "line L, column C: " (or ""), `problem` the rest."""

    def __init__(self, where: str, problem: str) -> None:
        self.where, self.problem = where, problem
        super().__init__(f"{where}{problem}")


def load(text: str) -> Any:
    """The YAML document of `text`, once it is within the limits (LimitError if not; a
    yaml.YAMLError for text that is not YAML)."""
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_BYTES:
        raise LimitError("", f"{size:,} bytes; a topology file is at most {MAX_BYTES:,} bytes")
    _check_events(text)
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass


def _at(event: yaml.Event) -> str:
    mark = event.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""


def _check_events(text: str) -> None:
    """Depth and expanded size from the event stream: every node counts 1, an alias the
    values of the node it names (kept per anchor when that node closes)."""
    values = 0
    opened: list[tuple[str | None, int]] = []  # (anchor, values before it) per open list or mapping
    sizes: dict[str, int] = {}  # anchor -> values of its node, aliases expanded
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            opened.append((event.anchor, values))
            values += 1
            if len(opened) > MAX_DEPTH:
                raise LimitError(_at(event), f"nested deeper than {MAX_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, before = opened.pop()
            if anchor is not None:
                sizes[anchor] = values - before
        elif isinstance(event, yaml.ScalarEvent):
            values += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            values += sizes.get(event.anchor, 1)  # an unknown anchor: the composer's error says so
        if values > MAX_VALUES:
            raise LimitError(
                _at(event), f"more than {MAX_VALUES:,} values (aliases expanded); a topology has far fewer"
            )


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping, and a key that is a list or
    a mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    "a key must be a string, a number or a boolean, not a list or a mapping",
                    key_node.start_mark,
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# Hydra's types for a value (hydra/grammar/OverrideLexer.g4, then its typed config): an int is
# decimal (`010` is 10, as an int field of Hydra's reads the string Hydra's lexer leaves), a float
# has a point or an exponent (or is inf or nan; YAML's .inf and .nan too), a bool is true or false
# and none is null, each in any case; every other plain scalar is a string. YAML 1.1's octal,
# sexagesimal (1:30), yes/no/on/off and dates are not.
_HYDRA_TYPES = [
    ("tag:yaml.org,2002:int", r"[-+]?[0-9](?:_?[0-9])*$", "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        r"[-+]?(?:(?:[0-9](?:_?[0-9])*)?\.[0-9](?:_?[0-9])*(?:[eE][-+]?[0-9]+)?"
        r"|[0-9](?:_?[0-9])*\.(?:[eE][-+]?[0-9]+)?"
        r"|[0-9](?:_?[0-9])*[eE][-+]?[0-9]+|\.?[iI][nN][fF]|\.?[nN][aA][nN])$",
        "-+0123456789.iInN",
    ),
    ("tag:yaml.org,2002:bool", r"(?:[tT][rR][uU][eE]|[fF][aA][lL][sS][eE])$", "tTfF"),
    ("tag:yaml.org,2002:null", r"(?:[nN][uU][lL][lL])$", "nN"),
]


class OverrideLoader(StrictLoader):
    """StrictLoader that types a plain scalar as Hydra's override grammar does."""

    yaml_implicit_resolvers: dict = {}

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        return int(str(self.construct_scalar(node)).replace("_", ""))

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        return float(
            str(self.construct_scalar(node)).replace("_", "").lower().replace(".inf", "inf").replace(".nan", "nan")
        )

    def construct_yaml_bool(self, node: yaml.ScalarNode) -> bool:
        return str(self.construct_scalar(node)).lower() == "true"


for _tag, _pattern, _first in _HYDRA_TYPES:
    OverrideLoader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))
OverrideLoader.add_constructor("tag:yaml.org,2002:int", OverrideLoader.construct_yaml_int)
OverrideLoader.add_constructor("tag:yaml.org,2002:float", OverrideLoader.construct_yaml_float)
OverrideLoader.add_constructor("tag:yaml.org,2002:bool", OverrideLoader.construct_yaml_bool)


def load_override(text: str) -> Any:
    """An override's VALUE, typed as Hydra types it (within the same limits as `load`)."""
    _check_events(text)
    return yaml.load(text, Loader=OverrideLoader)  # noqa: S506 - a SafeLoader subclass
