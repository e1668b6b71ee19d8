"""A bad topology as one line: pydantic's first error with the field's YAML path, the value
found (shortened) and what is allowed."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from app.option_table import BY_NAME
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
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):  # a model's; a dataclass section's
        return TopologyError(source, path, f"unknown key; allowed: {keys(_model_at(root, loc[:-1]))}")
    if kind in ("missing", "missing_keyword_only_argument"):
        return TopologyError(source, path, "missing; this key is required")
    if kind in ("model_type", "dict_type", "dataclass_type"):
        return TopologyError(
            source, path, f"got {show(err['input'])}; must be a mapping with keys {keys(_model_at(root, loc))}"
        )
    msg = err["msg"]
    msg = re.sub(r"^Value error, ", "", msg)
    msg = re.sub(r"^(Input|String|List) should (be|have|match)", lambda m: f"must {m.group(2)}", msg)
    return TopologyError(source, path, f"got {show(err['input'])}; {msg}")


def _model_at(root: type, loc: tuple) -> type:
    model = root
    for part in loc:
        field = section_fields(model).get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type) or not is_section(field.annotation):
            break
        model = field.annotation
    return model


def is_section(annotation: Any) -> bool:
    """A section of the topology: a pydantic model, or a dataclass pydantic validates (train, ps)."""
    return isinstance(annotation, type) and (issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation))


def section_fields(section: type) -> dict[str, FieldInfo]:
    """The fields of a section as pydantic reads them (a dataclass's: from each field's type and
    metadata, its description included), in order."""
    if issubclass(section, BaseModel):
        return dict(section.model_fields)
    assert dataclasses.is_dataclass(section), section
    hints = typing.get_type_hints(section, include_extras=True)
    out = {}
    for f in dataclasses.fields(section):
        info = FieldInfo.from_annotated_attribute(hints[f.name], f)
        option = BY_NAME.get(f.name)
        if option is not None and option.required:  # the app has a default, a topology file gives it
            info.default = PydanticUndefined
        out[f.name] = info
    return out


def keys(model: type) -> str:
    return ", ".join(section_fields(model))


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
