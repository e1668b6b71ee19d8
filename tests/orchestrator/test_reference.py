"""docs/topology.md is generated from the topology's field docstrings, and kept equal to them."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.reference_doc import REGENERATE, topology_reference_markdown
from orchestrator.topology.messages import is_section, section_fields
from orchestrator.topology.model import Topology

DOC = Path(__file__).resolve().parents[2] / "docs" / "topology.md"


def _leaves(model: type, prefix: str = "") -> list[tuple[str, object]]:
    """Every key of the topology that is not a section, dotted, with its FieldInfo."""
    out = []
    for name, f in section_fields(model).items():
        key = f"{prefix}{name}"
        if isinstance(f.annotation, type) and is_section(f.annotation):
            out.extend(_leaves(f.annotation, f"{key}."))
        else:
            out.append((key, f))
    return out


def test_docs_topology_md_is_the_generated_reference():
    assert DOC.read_text(encoding="utf-8") == topology_reference_markdown(), (
        f"docs/topology.md is out of date with orchestrator/topology/model.py; regenerate it: {REGENERATE}"
    )


def test_every_key_of_every_section_has_a_row_with_its_docstring():
    text = topology_reference_markdown()
    rows = {
        line.split(" | ")[0].removeprefix("| ").strip("`"): line for line in text.splitlines() if line.startswith("| `")
    }
    leaves = _leaves(Topology)
    assert len(leaves) > 20
    for key, field in leaves:
        assert key in rows, f"{key} has no row in the reference"
        assert field.description, (
            f"{key} has no docstring in orchestrator/topology/model.py (it is the reference's text)"
        )
        assert " ".join(field.description.split()).replace("|", "\\|") in rows[key]
    for section in ("image", "train", "ps", "workers", "network", "swarm"):
        assert f"## `{section}`" in text


def test_rows_carry_type_default_and_allowed_values():
    rows = {
        line.split(" | ")[0].removeprefix("| ").strip("`"): line.split(" | ")
        for line in topology_reference_markdown().splitlines()
        if line.startswith("| `")
    }
    strategies = "`async`, `sync`, `ssp`, `allreduce`, `diloco`, `diloco_async`"
    assert rows["train.strategy"][1:4] == ["string", "`async`", strategies]
    assert rows["train.batch_size"][1:4] == ["integer", "required", ">= 1"]
    assert rows["train.momentum"][3] == ">= 0, < 1"
    assert rows["ps.rpc_port"][1:4] == ["integer", "`29500`", "1024 to 65535"]
    assert rows["workers.gpus"][1:4] == ["list of integer", "unset", "each entry: >= 0"]
    assert rows["image.group_add"][2] == "`[]`"


def test_cli_schema_prints_the_reference_and_the_json_schema(cli):
    status, out, err = cli("schema", "--markdown")
    assert (status, err) == (0, "")
    assert out == topology_reference_markdown()
    status, out, _ = cli("schema")
    assert status == 0
    assert json.loads(out) == Topology.model_json_schema()


def test_the_readme_minimal_topology_is_valid():
    import re

    from orchestrator.topology.model import parse

    readme = (DOC.parents[1] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## A minimal topology\n\n```yaml\n(.*?)```", readme, re.S)
    assert block, "README.md has no '## A minimal topology' section with a yaml block"
    t = parse(block.group(1), "README.md")
    assert t.workers.count >= 1


SCHEMA = DOC.parents[1] / "configs" / "topology.schema.json"


def test_the_shipped_schema_is_the_topologys_and_every_shipped_config_names_it():
    """configs/topology.schema.json is `ps-compose schema`'s output, and each config's first
    line points editors (the YAML language server) at it."""
    assert json.loads(SCHEMA.read_text(encoding="utf-8")) == Topology.model_json_schema(), (
        f"configs/topology.schema.json is out of date; regenerate it: {REGENERATE}"
    )
    configs = sorted(SCHEMA.parent.glob("*.yaml")) + sorted((DOC.parents[1] / "examples").glob("*/*.yaml"))
    assert len(configs) >= 5
    for config in configs:
        first = config.read_text(encoding="utf-8").splitlines()[0]
        relative = Path(first.removeprefix("# yaml-language-server: $schema="))
        assert first.startswith("# yaml-language-server: $schema="), config
        assert (config.parent / relative).resolve() == SCHEMA, config


def test_an_editor_with_the_schema_validates_the_configs_and_catches_a_misspelt_key():
    import jsonschema
    import yaml

    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text(encoding="utf-8")))
    for config in sorted(SCHEMA.parent.glob("*.yaml")):
        doc = yaml.safe_load(config.read_text(encoding="utf-8"))
        assert list(validator.iter_errors(doc)) == [], config
    doc["train"]["learning_rate"] = 0.1
    errors = [e.message for e in validator.iter_errors(doc)]
    assert any("'learning_rate' was unexpected" in e for e in errors), errors
