"""A bad topology as one line: pydantic's first error with the field's YAML path, the value
found (shortened) and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from app.option_table import BY_NAME, OPTIONS
from orchestrator.errors import UsageError


class TopologyError(UsageError):
    """A bad topology: `path` is the YAML path of the field at fault."""

    def __init__(self, source: str, path: str, problem: str) -> None:
        self.source, self.path, self.problem = source, path, problem
        super().__init__(f"{source}: {path}: {problem}" if path else f"{source}: {problem}")


def first_error(e: ValidationError, source: str, root: type[BaseModel], data: Any = None) -> TopologyError:
    """The first pydantic error as one line with its YAML path (`data`: the mapping validated,
    whose keys name the near-namesake an unknown key may be meant as)."""
    err = e.errors()[0]
    loc = err["loc"]
    path = _dotted(loc)
    kind = err["type"]
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):  # a model's; a dataclass section's
        section = _model_at(root, loc[:-1])
        meant = _meant(str(loc[-1]), _dotted(loc[:-1]), section, _at(data, loc[:-1]))
        return TopologyError(source, path, f"unknown key; {meant}allowed: {keys(section)}")
    if kind in ("missing", "missing_keyword_only_argument"):
        return TopologyError(source, path, "missing; this key is required" + _given_as(loc, root, data))
    if kind in ("model_type", "dict_type", "dataclass_type"):
        return TopologyError(
            source, path, f"got {show(err['input'])}; must be a mapping with keys {keys(_model_at(root, loc))}"
        )
    msg = err["msg"]
    msg = re.sub(r"^Value error, ", "", msg)
    msg = re.sub(r"^(Input|String|List) should (be|have|match)", lambda m: f"must {m.group(2)}", msg)
    return TopologyError(source, path, f"got {show(err['input'])}; {msg}")


def near(given: str, known: list[str]) -> list[str]:
    """The names of `known` that `given` may be a misspelling or a long form of: close letter
    for letter (`batchsize`, `epoch`), or with their words' initials (`learning_rate`: `lr`)."""
    words = [w for w in re.split(r"[_\W]+", given.lower()) if w]
    initials = "".join(w[0] for w in words) if len(words) > 1 else None
    close = difflib.get_close_matches(given, known, n=3, cutoff=0.75)
    return [k for k in known if k.lower() == initials and k not in close] + close


def _meant(key: str, where: str, section: type, given: Any) -> str:
    """ "train.lr is required and missing: learning_rate for lr? " for an unknown key near a
    required key the section lacks; "did you mean lr? " for one near a key it allows."""
    fields = section_fields(section)
    candidates = near(key, [k for k in fields if k != key])
    if not candidates:
        return ""
    lacking = [k for k in candidates if fields[k].is_required() and isinstance(given, dict) and k not in given]
    if lacking:
        return f"{where + '.' if where else ''}{lacking[0]} is required and missing: is {key} meant as {lacking[0]}? "
    return f"did you mean {candidates[0]}? "


def _given_as(loc: tuple, root: type, data: Any) -> str:
    """ "; worker is given: is worker meant as workers?" for a missing key near an unknown one given."""
    given = _at(data, loc[:-1])
    if not isinstance(given, dict):
        return ""
    fields = section_fields(_model_at(root, loc[:-1]))
    for k in given:
        if isinstance(k, str) and k not in fields and str(loc[-1]) in near(k, [str(loc[-1])]):
            return f"; {k} is given: is {k} meant as {loc[-1]}?"
    return ""


def _at(data: Any, loc: tuple) -> Any:
    for part in loc:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def check_required(data: dict, source: str) -> None:
    """The options a topology file must give (the app has a default for each: the dataclass
    field has one, so pydantic cannot tell; checked once every given key is known)."""
    train = data.get("train", {})
    own_lr = isinstance(train.get("optimizer"), dict) and "lr" in train["optimizer"]
    if own_lr and "lr" in train:
        raise TopologyError(
            source, "train.lr", f"got {show(train['lr'])}; train.optimizer gives its own lr: give the rate once"
        )
    for o in OPTIONS:
        if o.required and o.key not in data.get(o.section, {}) and not (o.name == "lr" and own_lr):
            raise TopologyError(source, o.topology, "missing; this key is required")


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
