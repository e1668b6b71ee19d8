"""The classes built from app/options.py at run time (the topology's Train and PS, the app's
Config) have checked-in stubs the type checker reads (`make lint` runs mypy); the stubs are
what their generators write now, and declare exactly the fields the built classes have."""

from __future__ import annotations

import ast
import dataclasses

from app import config
from orchestrator.topology import model, stub

from orch_helpers import REPO

SECTIONS = REPO / "orchestrator/topology/sections.pyi"
CONFIG = REPO / "app/config_fields.pyi"


def declared(path, cls: str) -> dict[str, str]:
    """{field: default as source ('' when none)} of class `cls` in a stub."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {
        f.target.id: ast.unparse(f.value) if f.value is not None else ""
        for f in node.body
        if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
    }


def test_the_stubs_are_what_make_docs_writes() -> None:
    assert SECTIONS.read_text(encoding="utf-8") == stub.text(), "out of date: make docs"
    assert CONFIG.read_text(encoding="utf-8") == config.type_stub(), "out of date: make docs"


def test_the_section_stubs_declare_the_built_fields_and_defaults() -> None:
    for cls, base, built in (("Train", model._Train, model.Train), ("PS", model._PS, model.PS)):
        fields = declared(SECTIONS, cls)
        assert list(base.model_fields) + list(fields) == list(built.model_fields), cls  # the base's own first
        for name, info in built.model_fields.items():
            if name in base.model_fields:
                continue
            expected = "" if info.is_required() else repr(info.default)
            assert fields[name] == expected, (cls, name)


def test_the_config_stub_declares_the_built_fields_and_defaults() -> None:
    fields = declared(CONFIG, "Config")
    built = dataclasses.fields(config.Config)
    assert list(fields) == [f.name for f in built]
    assert {f.name: (repr(f.default) if f.name != "role" else "") for f in built} == fields
