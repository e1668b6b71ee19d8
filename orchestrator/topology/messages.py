"""A bad topology as one line: pydantic's first error with the field's YAML path, the value
found (shortened) and what is allowed."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ValidationError

from orchestrator.errors import UsageError


class TopologyError(UsageError):
    """A bad topology: `path` is the YAML path of the field at fault."""

    def __init__(self, source: str, path: str, problem: str) -> None:
        self.source, self.path, self.problem = source, path, problem
        super().__init__(f"{source}: {path}: {problem}" if path else f"{source}: {problem}")


def first_error(e: ValidationError, source: str, root: type[BaseModel]) -> TopologyError:
    """The first pydantic error as one line with its YAML path."""
    err = e.errors()[0]
    loc = err["loc"]
    path = _dotted(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        return TopologyError(source, path, f"unknown key; allowed: {keys(_model_at(root, loc[:-1]))}")
    if kind == "missing":
        return TopologyError(source, path, "missing; this key is required")
    if kind in ("model_type", "dict_type"):
        return TopologyError(
            source, path, f"got {show(err['input'])}; must be a mapping with keys {keys(_model_at(root, loc))}"
        )
    msg = err["msg"]
    msg = re.sub(r"^Value error, ", "", msg)
    msg = re.sub(r"^(Input|String|List) should (be|have|match)", lambda m: f"must {m.group(2)}", msg)
    return TopologyError(source, path, f"got {show(err['input'])}; {msg}")


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel]:
    model = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            break
        model = field.annotation
    return model


def keys(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def yaml_type(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), type(value).__name__
    )
