"""Hostile YAML (orchestrator/topology/yaml_text.py): an alias bomb, deep nesting, a key that is
a list, a huge file and a worker count past any host each give one line and exit 2 from
`render`, with nothing written (before: minutes and gigabytes for a 1.4 KB bomb, a
RecursionError, `TypeError: unhashable type`, and 10,000,000 workers taken as given)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.topology import yaml_text
from orchestrator.topology.model import TopologyError, load_with, parse

from orch_helpers import REPO

SMOKE = (REPO / "configs" / "cpu-smoke.yaml").read_text()


def alias_bomb(levels: int) -> str:
    """The billion laughs: each level nine aliases of the one before; `name` the last."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + f"\nname: *a{levels - 1}\n"


HOSTILE = [
    # 9 levels: 9**9 (387 million) strings from 1.4 KB
    ("alias-bomb", alias_bomb(9), "more than 10,000 values (aliases expanded)"),
    ("deep-nesting", "name: x\ntrain: " + "[" * 600 + "]" * 600 + "\n", "nested deeper than 32 levels"),
    ("deep-mappings", "".join(f"{'  ' * i}k{i}:\n" for i in range(40)) + "  " * 40 + "v: 1\n", "nested deeper"),
    ("list-key", "? [a]\n: 1\n", "a key must be a string, a number or a boolean, not a list or a mapping"),
    ("mapping-key", "? {a: 1}\n: 1\n", "a key must be a string, a number or a boolean"),
    ("huge-file", "# " + "x" * yaml_text.MAX_BYTES + "\n" + SMOKE, "bytes; a topology file is at most 1,048,576"),
    ("ten-million-workers", SMOKE.replace("count: 2", "count: 10000000"), "workers.count: got 10000000; must be"),
    ("workers-2-63", SMOKE.replace("count: 2", f"count: {2**63}"), "workers.count: got 9223372036854775808"),
    ("max-past-the-bound", SMOKE.replace("count: 2", "count: 2\n  max: 5000"), "workers.max: got 5000; must be"),
]


@pytest.mark.parametrize("text,expected", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_yaml_is_one_line_and_exit_2_with_nothing_written(cli, tmp_path: Path, text, expected) -> None:
    config = tmp_path / "hostile.yaml"
    config.write_text(text)
    out = tmp_path / "out" / "compose.yaml"
    out.parent.mkdir()

    status, stdout, stderr = cli("render", "-c", str(config), "-o", str(out))

    assert status == 2 and stdout == ""
    assert len(stderr.splitlines()) == 1 and expected in stderr, stderr[:500]
    assert list(out.parent.iterdir()) == []


def test_an_error_names_the_line_and_column_of_the_33rd_level():
    with pytest.raises(TopologyError) as e:
        parse("name: x\ntrain:\n  a: " + "[" * 40 + "]" * 40 + "\n", "t.yaml")
    assert str(e.value) == "t.yaml: not a topology: line 3, column 36: nested deeper than 32 levels"


def test_aliases_within_the_limit_and_nesting_of_real_topologies_still_load():
    shared = SMOKE.replace("train:\n", "x-recipe: &recipe {lr: 0.1, seed: 3}\ntrain:\n", 1)
    doc = yaml_text.load(shared)
    assert doc["x-recipe"] == {"lr": 0.1, "seed": 3}
    for config in sorted((REPO / "configs").glob("*.yaml")):
        assert load_with(config).name  # every shipped config is within every limit


def test_the_workers_override_is_bounded_like_the_file():
    with pytest.raises(TopologyError) as e:
        load_with(REPO / "configs" / "cpu-smoke.yaml", workers=5000)
    assert str(e.value).endswith("workers.count: got 5000; must be from 1 to 1024")
