"""The option-built topology sections as a type checker sees them.

`Train` and `PS` (orchestrator/topology/model.py) get one field per option of app/options.py
at run time (pydantic's `create_model`), which no checker or editor follows. This module writes
orchestrator/topology/sections.pyi, a stub of the same classes declared field by field, which
model.py imports under TYPE_CHECKING alone (a stub: nothing runs it). `make docs` writes it
again; tests/orchestrator/test_typing.py fails when the checked-in file is not what this
writes. The app's `Config` has its own (app/config.py `type_stub`).

    python -m orchestrator.topology.stub > orchestrator/topology/sections.pyi
"""

from __future__ import annotations

import sys

from app.options import Option, in_topology
from orchestrator.topology.model import SECTION_EXTRAS

HEADER = '''"""The option-built topology sections, declared field by field for the type checker.

Written by `python -m orchestrator.topology.stub` from app/options.py (`make docs`); do not
edit. orchestrator/topology/model.py builds the real classes at run time and imports these
under TYPE_CHECKING alone.
"""

from typing import Literal, Optional, Union

from orchestrator.topology.model import _PS, _Train
'''
BASES = {"train": ("Train", "_Train"), "ps": ("PS", "_PS")}


def annotation(o: Option) -> str:
    """The type of an option's topology field, as source text."""
    if o.choices:
        return "Literal[" + ", ".join(f'"{c}"' for c in o.choices) + "]"
    kind = o.topology_kind or o.kind
    return {"int": "int", "float": "float", "bool": "bool", "str": "str", "auto_int": 'Union[Literal["auto"], int]'}[
        kind
    ]


def default(o: Option) -> str:
    """` = <default>` as source text; nothing for a field the topology file must give."""
    if o.required:
        return ""
    value = int(o.default) if o.topology_kind == "int" else o.default
    return f" = {value!r}".replace("'", '"')


def section(name: str) -> str:
    cls, base = BASES[name]
    lines = [f"class {cls}({base}):"]
    for o in in_topology(name):
        lines.append(f"    {o.key}: {annotation(o)}{default(o)}")
        extras = SECTION_EXTRAS.get(name, {}).get(o.key, {})
        lines += [f"    {key}: {str(kind).replace('typing.', '')} = None" for key, (kind, _) in extras.items()]
    return "\n".join(lines) + "\n"


def text() -> str:
    """orchestrator/topology/sections.pyi."""
    return HEADER + "".join(f"\n{section(name)}" for name in BASES)


if __name__ == "__main__":
    sys.stdout.write(text())
