"""The app's layout: the import graph of app.* has no cycle (imports inside functions count),
no module uses another app module's private names, and the contract module is torch-free."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "app"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def app_modules() -> dict[str, tuple[Path, ast.Module]]:
    return {module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(APP.rglob("*.py"))}


def resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a `from X import ...` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(modules: dict[str, tuple[Path, ast.Module]]) -> dict[str, list[tuple[str, str, int]]]:
    """{module: [(imported app module, name imported from it or "", line)]}, from every
    import statement anywhere in the module (functions, TYPE_CHECKING blocks...)."""
    found: dict[str, list[tuple[str, str, int]]] = {m: [] for m in modules}
    for name, (path, tree) in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    if target:
                        found[name].append((target, "", node.lineno))
            elif isinstance(node, ast.ImportFrom):
                source = resolve(node, name, path.name == "__init__.py")
                if source not in modules:
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in modules:
                        found[name].append((submodule, "", node.lineno))
                    else:
                        found[name].append((source, alias.name, node.lineno))
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_app_import_graph_has_no_cycle():
    modules = app_modules()
    assert {"app.contract", "app.training.loop", "app.ps.server", "app.worker.trainer"} <= set(modules)
    edges = imports(modules)
    graph = {m: {target for target, _, _ in found if target != m} for m, found in edges.items()}
    assert sum(len(targets) for targets in graph.values()) > 50  # the walk sees the imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_app_module_uses_another_ones_private_names():
    modules = app_modules()
    offences = []
    for name, found in imports(modules).items():
        offences += [
            f"{name}:{line} imports {target}.{imported}"
            for target, imported, line in found
            if imported.startswith("_") and target != name
        ]
        path, tree = modules[name]
        bound = {}  # local name -> the app module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = resolve(node, name, path.name == "__init__.py")
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in modules:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                offences.append(f"{name}:{node.lineno} uses {bound[node.value.id]}.{node.attr}")
    assert offences == [], "\n".join(offences)


def test_no_two_letter_aliases_of_the_project_modules_in_app_and_bench():
    aliases = []
    for path in sorted([*APP.rglob("*.py"), *(REPO / "bench").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                "app",
                "orchestrator",
                "bench",
            ):
                aliases += [
                    f"{path.name}: {a.name} as {a.asname}" for a in node.names if a.asname and len(a.asname) <= 2
                ]
            elif isinstance(node, ast.Import):
                aliases += [
                    f"{path.name}: {a.name} as {a.asname}"
                    for a in node.names
                    if a.name.split(".")[0] in ("app", "orchestrator", "bench") and a.asname and len(a.asname) <= 2
                ]
    assert aliases == [], "\n".join(aliases)


@pytest.mark.parametrize("module", ["app.contract", "app.config"])
def test_the_contract_and_the_config_import_without_torch(module):
    tree = ast.parse((APP / (module.split(".")[1] + ".py")).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in ("torch", "torchvision", "numpy")]
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr


def test_the_contract_module_imports_nothing_of_the_app():
    tree = ast.parse((APP / "contract.py").read_text())
    sources = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    sources += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert [s for s in sources if s.split(".")[0] == "app"] == []  # the standard library only: test_import_graph


DESIGN = REPO / "docs" / "design.md"


def layers() -> dict[str, int]:
    """docs/design.md's app layer table: unit (app.<unit>) -> layer."""
    block = DESIGN.read_text(encoding="utf-8").split("<!-- app-layers:", 1)[1].split("<!-- /app-layers -->", 1)[0]
    out: dict[str, int] = {}
    for line in block.splitlines():
        columns = re.split(r"\s{2,}", line.strip())  # layer, units, what they hold
        if columns[0].isdigit():
            out.update({f"app.{unit}": int(columns[0]) for unit in columns[1].split()})
    return out


def unit_of(module: str, table: dict[str, int]) -> str:
    """The unit of the table that `module` is or lies in."""
    found = [u for u in table if module == u or module.startswith(u + ".")]
    assert found, f"{module} is in no unit of docs/design.md's app layer table"
    return max(found, key=len)


def test_the_app_layer_table_is_read_and_names_every_module():
    table = layers()
    assert table["app.__main__"] == max(table.values()) and table["app.contract"] == 0
    assert table["app.ps"] == table["app.worker"] == table["app.allreduce"]
    modules = app_modules()
    for module in modules:
        if module != "app":
            unit_of(module, table)
    assert set(table) <= set(modules), sorted(set(table) - set(modules))  # no unit that is not there


def test_imports_go_down_the_app_layer_table():
    """The PS, a worker and allreduce import nothing of one another (they share a layer); they
    meet in app.exchange and app.contract."""
    table, edges = layers(), imports(app_modules())
    bad = []
    for module, found in edges.items():
        if module == "app":
            continue
        mine = unit_of(module, table)
        for target, _, line in found:
            if target == "app":
                continue
            theirs = unit_of(target, table)
            if theirs != mine and table[theirs] >= table[mine]:
                bad.append(f"{module}:{line} (layer {table[mine]}) -> {target} (layer {table[theirs]})")
    assert not bad, "imports against docs/design.md's app layers:\n" + "\n".join(bad)


def test_a_worker_importing_the_ps_is_caught_by_the_table():
    table = layers()
    assert unit_of("app.worker.trainer", table) == "app.worker" and unit_of("app.ps.server", table) == "app.ps"
    assert table["app.ps"] >= table["app.worker"]  # so worker -> ps is refused above, and ps -> worker
    assert table["app.exchange"] < table["app.worker"]


def test_only_the_exchange_maps_its_segment_or_knows_its_layout():
    """Slots, regions and partitions are app.exchange's: no module outside it imports the
    segment or the layout, and the worker's trainer imports none of the routes that carry its
    pushes (it asks the one its channel chose)."""
    edges = imports(app_modules())
    private = {
        "app.exchange.segment",
        "app.exchange.layout",
        "app.exchange.backward_copies",
        "app.exchange.ordered_pull",
    }
    bad = [
        f"{name}:{line} imports {target}"
        for name, found in edges.items()
        if not name.startswith("app.exchange")
        for target, _, line in found
        if target in private
    ]
    bad += [
        f"app.worker.trainer imports {t}"
        for t, _, _ in edges["app.worker.trainer"]
        if t in ("app.exchange.shared_route", "app.exchange.socket_route", "app.worker.sharded")
    ]
    assert not bad, "\n".join(bad)


def test_the_ps_policies_and_endpoints_import_no_server():
    """A strategy's policy is given the PS's parts (state, members, reply buffers, counts) and
    returns whom to answer: it imports nothing of app.ps.server, so it cannot call the server
    back. The RPC endpoints serve what app.ps.rpc.Served says, not a server class."""
    edges = imports(app_modules())
    policies = [m for m in edges if m == "app.ps.policies" or m.startswith("app.ps.policies.")]
    assert "app.ps.policies.rounds" in policies and "app.ps.rpc" in edges
    bad = [
        f"{name}:{line} imports {target}{'.' + imported if imported else ''}"
        for name in [*policies, "app.ps.rpc"]
        for target, imported, line in edges[name]
        if target == "app.ps.server"
    ]
    assert not bad, "\n".join(bad)


SIZED = ["app/ps"]  # where the size rule holds
MAX_CLASS_LINES, MAX_MODULE_LINES = 300, 500


def oversized(root: Path) -> list[str]:
    """Each module under `root` over MAX_MODULE_LINES lines, and each class over MAX_CLASS_LINES."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text, name = path.read_text(), path.relative_to(root).as_posix()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1 if isinstance(node, ast.ClassDef) else 0
            if lines > MAX_CLASS_LINES:
                found.append(f"{name}: class {getattr(node, 'name', '')}, {lines} lines")
    return found


def test_oversized_finds_a_long_class_and_a_long_module(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    (tmp_path / "long.py").write_text(f"class Long:\n{body}\n" + "\n" * MAX_MODULE_LINES)
    (tmp_path / "short.py").write_text("class Short:\n    x = 1\n")
    assert oversized(tmp_path) == [
        f"long.py: {MAX_MODULE_LINES + MAX_CLASS_LINES + 1} lines",
        f"long.py: class Long, {MAX_CLASS_LINES + 1} lines",
    ]


@pytest.mark.parametrize("where", SIZED)
def test_no_class_over_300_lines_and_no_module_over_500(where):
    found = oversized(REPO / where)
    assert found == [], f"in {where}:\n" + "\n".join(found)


def test_no_module_of_the_app_uses_torch_rpc():
    """torch.distributed.rpc (which unpickles what whoever connects sends) is neither imported
    nor named anywhere in the app: its processes talk over the job's own transport alone."""
    naming = sorted(
        str(path.relative_to(APP.parent))
        for path in APP.rglob("*.py")
        if "torch.distributed.rpc" in path.read_text(encoding="utf-8")
    )
    assert naming == []
