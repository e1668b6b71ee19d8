"""The orchestrator's import graph: no cycle, no torch, no app, no private name taken
from another module. Every import counts, function-level ones too (parsed with `ast`,
relative imports resolved), so a lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrator"
FORBIDDEN = ("torch", "app")  # the orchestrator runs on a host without the app's venv


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import in the file, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, [a.name for a in node.names], node.lineno))
    return found


def graph() -> dict[str, set[str]]:
    """orchestrator module -> the orchestrator modules it imports (`from pkg import mod` counts as mod)."""
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for module, names, _ in imports(name, path):
            if module not in known:
                continue
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
            if len(targets) < len(names) or not names:  # names taken from the module itself
                targets.append(module)
            edges[name].update(t for t in targets if t != name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (each as the path that closes it)."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_the_graph_is_read() -> None:
    edges = graph()
    assert "orchestrator.cli" in edges and "orchestrator.topology.model" in edges
    assert "orchestrator.topology.model" in edges["orchestrator.render.compose"]
    assert "orchestrator.chaos.processes" in edges["orchestrator.chaos.registry"]


def test_no_import_cycle() -> None:
    edges = graph()
    found = cycles(edges)
    assert not found, (
        "import cycles:\n"
        + "\n".join(" -> ".join(c) for c in found)
        + "\n\nthe graph:\n"
        + "\n".join(f"{m} -> {', '.join(sorted(t))}" for m, t in sorted(edges.items()) if t)
    )


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# The app's declarations the orchestrator reads: standard library only (held so below).
APP_DECLARATIONS = (
    "app.options",
    "app.option_rules",
    "app.option_table",
    "app.recipes",
    "app.contract",
    "app.model_sizes",
    "app.publish",
)


def test_no_torch_and_no_app() -> None:
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: imports {module}"
        for name, path in modules().items()
        for module, _, line in imports(name, path)
        if module.split(".")[0] in FORBIDDEN and module not in APP_DECLARATIONS
    ]
    assert not bad, "\n".join(bad)


def test_the_app_declarations_import_only_the_standard_library() -> None:
    import sys

    root = PACKAGE.parent
    for name in APP_DECLARATIONS:
        path = root / (name.replace(".", "/") + ".py")
        for module, _, line in imports(name, path):
            top = module.split(".")[0]
            assert module in APP_DECLARATIONS or top in sys.stdlib_module_names or top == "__future__", (
                f"{path.relative_to(root)}:{line}: imports {module}"
            )
    init = (root / "app" / "__init__.py").read_text(encoding="utf-8")
    assert not [n for n in ast.walk(ast.parse(init)) if isinstance(n, (ast.Import, ast.ImportFrom))], (
        "app/__init__.py imports something: the orchestrator's `import app.options` would run it"
    )


def test_no_private_name_from_another_module() -> None:
    known = modules()
    bad = []
    for name, path in known.items():
        for module, names, line in imports(name, path):
            if module.startswith("orchestrator") and module != name:
                bad += [
                    f"{path.relative_to(PACKAGE.parent)}:{line}: {n} from {module}"
                    for n in names
                    if n.startswith("_") and not n.startswith("__")
                ]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {
            a.asname or a.name: f"{node.module}.{a.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
            for a in node.names
            if f"{node.module}.{a.name}" in known
        }
        aliases.update(
            {
                a.asname or a.name: a.name
                for node in ast.walk(tree)
                if isinstance(node, ast.Import)
                for a in node.names
                if a.name in known
            }
        )
        bad += [
            f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ]
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


DESIGN = PACKAGE.parent / "docs" / "design.md"
NO_IO_IN_RENDER = ("os", "subprocess", "socket", "docker", "shutil")


def layers() -> dict[str, int]:
    """docs/design.md's layer table: unit (orchestrator.<unit>) -> layer."""
    text = DESIGN.read_text(encoding="utf-8")
    block = text.split("<!-- layers:", 1)[1].split("<!-- /layers -->", 1)[0]
    out: dict[str, int] = {}
    for line in block.splitlines():
        columns = re.split(r"\s{2,}", line.strip())  # layer, units, what they hold
        if columns[0].isdigit():
            out.update({f"orchestrator.{unit}": int(columns[0]) for unit in columns[1].split()})
    return out


def unit_of(module: str, table: dict[str, int]) -> str:
    """The longest unit of the table that `module` is or lies in."""
    found = [u for u in table if module == u or module.startswith(u + ".")]
    assert found, f"{module} is in no unit of docs/design.md's layer table"
    return max(found, key=len)


def test_the_layer_table_is_read_and_names_every_module() -> None:
    table = layers()
    assert table["orchestrator.cli"] == 8 and table["orchestrator.metrics.records"] == 0
    assert table["orchestrator.backends"] == 4 and table["orchestrator.topology"] == 1
    assert table["orchestrator.verbs"] == 5  # every verb in one home
    assert len(table) == 25, sorted(table)  # every unit, and no word of the description
    for module in modules():
        if module != "orchestrator":
            unit_of(module, table)


def test_imports_go_down_the_design_map() -> None:
    table, edges = layers(), graph()
    bad = []
    for module, targets in edges.items():
        if module == "orchestrator":
            continue
        mine = unit_of(module, table)
        for target in targets:
            if target == "orchestrator":
                continue
            theirs = unit_of(target, table)
            if theirs != mine and table[theirs] >= table[mine]:
                bad.append(f"{module} (layer {table[mine]}) -> {target} (layer {table[theirs]})")
    assert not bad, "imports against docs/design.md's layers:\n" + "\n".join(bad)


def test_a_wrong_import_is_caught_by_the_map() -> None:
    table = layers()
    assert (
        table[unit_of("orchestrator.render.compose", table)] < table[unit_of("orchestrator.backends.registry", table)]
    )
    assert unit_of("orchestrator.metrics.records", table) == "orchestrator.metrics.records"
    assert unit_of("orchestrator.metrics.report", table) == "orchestrator.metrics"


def test_the_renders_do_no_io() -> None:
    for name in ("orchestrator.render.compose", "orchestrator.render.swarm", "orchestrator.render.kubernetes"):
        found = [m for m, _, _ in imports(name, modules()[name]) if m.split(".")[0] in NO_IO_IN_RENDER]
        assert not found, f"{name} imports {found}"
