"""The kinds of value a topology field takes beyond pydantic's own: a number YAML read as
text, a size, a group, a loader count, a Swarm node, a Kubernetes node selector. Each
rejects a bad value with the one-line rule it breaks (pydantic puts the file and the
field's YAML path in front: orchestrator/topology/messages.py). `Section` is every
section's base: strict types, no unknown key, frozen."""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

_GROUP = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([bkmg]?)b?$")
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_FLOAT = re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$")


def yaml_float(value: Any) -> Any:
    # PyYAML (YAML 1.1) reads `1e-3` as a string; accept it as the number it means.
    if isinstance(value, str) and _FLOAT.match(value.strip()):
        return float(value)
    return value


_TYPE_NAMES = {"int": "integer", "float": "number", "bool": "boolean", "str": "string"}


def exact_value(kind: str, value: Any) -> Any:
    """A YAML value as an option of `kind` (int, float, bool, str) takes it: no coercion
    (`batch_size: "256"` is a string, `lr: true` no number), but a float PyYAML read as
    text (`1e-3`) is the number it means. ValueError in pydantic's own words otherwise."""
    if kind == "float":
        value = yaml_float(value)
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
    }[kind](value)
    if not ok:
        raise ValueError(f"Input should be a valid {_TYPE_NAMES[kind]}")
    return value


def _size(value: Any) -> Any:
    """A size as compose takes it: bytes (int) or '512m', '2g', '1gb'."""
    if isinstance(value, bool):
        raise ValueError("must be a size like 512m or 2g, or a number of bytes")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("must be a positive size like 512m or 2g, or a number of bytes")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value.strip().lower())
        if m and float(m.group(1)) > 0:
            return value.strip().lower()
    raise ValueError("must be a positive size like 512m or 2g, or a number of bytes")


def size_bytes(size: int | str) -> int:
    """A size as the topology takes it (bytes, '256m', '2g', '1gb') in bytes."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(size.strip().lower())
    if m is None:
        raise ValueError(f"not a size: {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _group(value: Any) -> Any:
    """A group for group_add: a numeric gid or a group name."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _GROUP.match(value):
        return value
    raise ValueError("must be a group id (a number >= 0, e.g. 44) or a group name like video")


def loader_workers(value: Any) -> Any:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError("must be auto or a whole number >= 0")


GroupId = Annotated[Union[int, str], BeforeValidator(lambda v: _group(v))]
Size = Annotated[Union[int, str], BeforeValidator(_size)]


class Section(BaseModel):
    # strict: `batch_size: "256"` or `count: true` is a wrong type, not coerced.
    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True, allow_inf_nan=False
    )


# The pydantic config of a section that is a dataclass (train, ps: app/options.py's fields).
# Not strict as a whole (pydantic would then take only an instance): the section's checks take
# each value as it is (`exact_value`).
SECTION_CONFIG = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # inf: one line, never a render


_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_NODE_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}=[A-Za-z0-9._-]{1,253}$")


def _node(v: str) -> str:
    if not (_NODE.match(v) or _NODE_LABEL.match(v)):
        raise ValueError("must be a node hostname like gpu-a, or a node label as key=value like gpu=true")
    return v


Node = Annotated[str, AfterValidator(_node)]


_LABEL_KEY = re.compile(r"^(?:[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def _node_selector(v: dict[str, str]) -> dict[str, str]:
    for key, value in v.items():
        if not _LABEL_KEY.match(key):
            raise ValueError(f"label key {key!r} must be a Kubernetes label key like kubernetes.io/hostname or gpu")
        if not _LABEL_VALUE.match(value):
            raise ValueError(f"label value {value!r} (of {key}) must be at most 63 letters, digits, '-', '_' or '.'")
    return v


NodeSelector = Annotated[dict[str, str], AfterValidator(_node_selector)]
