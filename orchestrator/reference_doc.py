"""The topology reference (docs/topology.md), generated from the topology's sections.

`topology_reference_markdown()` walks the sections of the topology (pydantic models, and the
dataclasses of app/options.py's options that pydantic validates) and
writes one table per section: each key with its type, default, allowed values
and its attribute docstring. Pure: the same models give the same text, so a
test can hold docs/topology.md equal to it. Whatever fields the models have
appear; nothing here names a field.
"""

from __future__ import annotations

import json
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from orchestrator.topology.messages import is_section, section_fields
from orchestrator.topology.model import Topology

REGENERATE = "make docs  (python -m orchestrator schema --markdown > docs/topology.md)"

_HEADER = """\
# Topology reference

<!-- Generated from the field docs of app/options.py and orchestrator/topology/{model,option_sections,fields}.py
     by `python -m orchestrator schema --markdown`; `make docs` rewrites this file. -->

A topology is one YAML file (`configs/*.yaml`) that describes a whole run: the
image, the training job, the parameter server, the workers, the network and,
for Docker Swarm, the placement. Every verb that works on a topology takes it
with `-c FILE`; `--workers N` and `--strategy S` override `workers.count` and
`train.strategy`, and any key is overridden after the flags, Hydra's way:
`KEY=VALUE` with a dotted key and a YAML value (`train.lr=0.05 workers.count=3
train.optimizer.name=adamw`), `~KEY` to remove one; the rendered file's header
records them.

Every key is checked before anything is written or started. An unknown key, a
missing required key, a wrong type (`batch_size: "256"` is a string, not a
number) or a value out of range stops the command with exit status 2 and one
line naming the file, the key, the value and what is allowed:

```
error: t.yaml: train.epoch: unknown key; did you mean epochs? allowed: model, dataset, ...
error: configs/cpu-smoke.yaml with train.lr=fast: train.lr: got 'fast'; must be a valid number
error: t.yaml: train.learning_rate: unknown key; train.lr is required and missing: is learning_rate meant as lr? allowed: ...
error: configs/default.yaml with --workers 5: workers.gpus: got [0, 1, 2] for 5 workers; must list one GPU id per worker (or leave it out for 0..4)
```

The file itself is read within limits, each one far past any real topology: at
most 1 MiB, nested at most 32 levels, at most 10,000 values with its YAML
aliases expanded, keys that are strings, numbers or booleans (each once per
mapping), and at most 1,024 workers (`workers.count`, `workers.max`).

Some rules span several keys (for example `train.overlap` only with `async` or
`ssp`, `ps.shards` only with a parameter server); the descriptions below say
where one applies.
"""


def topology_reference_markdown() -> str:
    """The whole reference as Markdown: the header, then the top-level keys, then one section per model."""
    parts = [_HEADER]
    top = [(name, f) for name, f in section_fields(Topology).items() if _section_model(f.annotation) is None]
    if top:
        parts.append(_table("Top level", None, [(name, f) for name, f in top]))
    for name, f in section_fields(Topology).items():
        model = _section_model(f.annotation)
        if model is not None:
            parts.extend(_sections(name, f, model))
    return "\n".join(parts)


def _sections(path: str, field: FieldInfo, model: type) -> list[str]:
    """The table of one section, then those of the sections nested in it."""
    intro = " ".join(
        filter(
            None,
            [
                _clean(model.__doc__ or ""),
                _clean(field.description or ""),
                "Optional: every key has a default." if not field.is_required() else "",
            ],
        )
    )
    fields = section_fields(model)
    leaves = [(f"{path}.{name}", f) for name, f in fields.items() if _section_model(f.annotation) is None]
    out = [_table(f"`{path}`", intro, leaves)]
    for name, f in fields.items():
        nested = _section_model(f.annotation)
        if nested is not None:
            out.extend(_sections(f"{path}.{name}", f, nested))
    return out


def _table(title: str, intro: str | None, fields: list[tuple[str, FieldInfo]]) -> str:
    lines = [f"## {title}", ""]
    if intro:
        lines += [intro, ""]
    lines += ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    for key, f in fields:
        cells = [f"`{key}`", _type_name(f.annotation), _default(f), _allowed(f), _clean(f.description or "")]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _section_model(annotation: Any) -> type | None:
    """The model (or dataclass) of a section field (also when Optional), else None."""
    inner = _strip_none(annotation)
    return inner if is_section(inner) else None


def _strip_none(annotation: Any) -> Any:
    if _is_union(annotation):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _type_name(annotation: Any) -> str:
    """A type as a YAML user reads it: string, integer, number, boolean, list of ..."""
    annotation = _strip_none(annotation)
    origin = get_origin(annotation)
    if origin is Annotated:
        return _type_name(get_args(annotation)[0])
    if origin is Literal:
        return " or ".join(dict.fromkeys(_SCALARS.get(type(v), type(v).__name__) for v in get_args(annotation)))
    if origin is list:
        return f"list of {_type_name(get_args(annotation)[0])}"
    if _is_union(annotation):
        return " or ".join(_type_name(a) for a in get_args(annotation) if a is not type(None))
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default(f: FieldInfo) -> str:
    if f.is_required():
        return "required"
    value = f.default_factory() if f.default_factory is not None else f.default  # type: ignore[call-arg]
    if value is None or value is PydanticUndefined:
        return "unset"
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def _allowed(f: FieldInfo) -> str:
    """Allowed values: a Literal's choices, numeric bounds, lengths, patterns, validators' docstrings."""
    notes = _choices(f.annotation) + _constraints(f.metadata, _is_list(f.annotation))
    notes += _item_notes(f.annotation)
    return "; ".join(notes)


def _choices(annotation: Any) -> list[str]:
    annotation = _strip_none(annotation)
    if get_origin(annotation) is Literal:
        return [", ".join(f"`{v}`" for v in get_args(annotation))]
    return []


def _is_list(annotation: Any) -> bool:
    return get_origin(_strip_none(annotation)) is list


def _item_notes(annotation: Any) -> list[str]:
    """Constraints on each entry of a list, or on an Optional's Annotated value."""
    annotation = _strip_none(annotation)
    if get_origin(annotation) is list:
        notes = _annotated_notes(get_args(annotation)[0])
        return [f"each entry: {n}" for n in notes]
    return _annotated_notes(annotation)


def _annotated_notes(annotation: Any) -> list[str]:
    if get_origin(annotation) is not Annotated:
        return []
    metadata: list[Any] = []
    for m in get_args(annotation)[1:]:
        metadata.extend(m.metadata if isinstance(m, FieldInfo) else [m])
    return _constraints(metadata, False)


def _constraints(metadata: list[Any], is_list: bool) -> list[str]:
    bounds: dict[str, Any] = {type(m).__name__: m for m in metadata if isinstance(m, (at.Gt, at.Ge, at.Lt, at.Le))}
    notes: list[str] = []
    if "Ge" in bounds and "Le" in bounds:
        notes.append(f"{bounds.pop('Ge').ge} to {bounds.pop('Le').le}")
    for name, symbol, attr in (("Gt", ">", "gt"), ("Ge", ">=", "ge"), ("Lt", "<", "lt"), ("Le", "<=", "le")):
        if name in bounds:
            notes.append(f"{symbol} {getattr(bounds[name], attr)}")
    if len(notes) == 2 and notes[0].startswith(">") and notes[1].startswith("<"):
        notes = [", ".join(notes)]
    for m in metadata:
        if isinstance(m, at.MinLen):
            entries = "entry" if m.min_length == 1 else "entries"
            notes.append(f"at least {m.min_length} {entries}" if is_list else "not empty")
        elif isinstance(m, at.MaxLen):
            notes.append(f"at most {m.max_length} {'entries' if is_list else 'characters'}")
        elif getattr(m, "pattern", None):
            notes.append(f"matches `{m.pattern}`")
        elif getattr(getattr(m, "func", None), "__doc__", None):
            doc = _clean(m.func.__doc__).rstrip(".")
            notes.append(doc[:1].lower() + doc[1:])
    return notes


def _clean(text: str) -> str:
    """A docstring as one line."""
    return " ".join(text.split())
