"""No module over 500 lines and no class over 300 in app/, orchestrator/ and bench/: a file
or a class past that holds more than one job and is split before it grows further. The
vendored file (bench/vendor/) is kept as its source wrote it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "orchestrator", "bench")
VENDORED = ROOT / "bench" / "vendor"
MODULE_LINES = 500
CLASS_LINES = 300


def sources() -> list[Path]:
    return [
        p
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
        if VENDORED not in p.parents and "__pycache__" not in p.parts
    ]


def too_long(path: Path, root: Path = ROOT) -> list[str]:
    """'path: what, N lines' for the module itself and each class (nested ones too) over its limit."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(root)
    found = []
    lines = len(text.splitlines())
    if lines > MODULE_LINES:
        found.append(f"{name}: module, {lines} lines (at most {MODULE_LINES})")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.ClassDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > CLASS_LINES:
                found.append(f"{name}:{node.lineno}: class {node.name}, {length} lines (at most {CLASS_LINES})")
    return found


def test_every_package_is_read() -> None:
    read = {p.relative_to(ROOT).parts[0] for p in sources()}
    assert read == set(PACKAGES)
    assert not any(VENDORED in p.parents for p in sources())


def test_no_module_over_500_lines_and_no_class_over_300() -> None:
    found = [line for path in sources() for line in too_long(path)]
    assert not found, "split these:\n" + "\n".join(found)


def test_a_long_class_and_a_long_module_are_found(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(CLASS_LINES))
    long_class = tmp_path / "long_class.py"
    long_class.write_text(f"class Big:\n{body}\n", encoding="utf-8")
    short = tmp_path / "short.py"
    short.write_text("class Small:\n    pass\n", encoding="utf-8")
    long_module = tmp_path / "long_module.py"
    long_module.write_text("\n".join(f"y{i} = {i}" for i in range(MODULE_LINES + 1)) + "\n", encoding="utf-8")
    assert too_long(long_class, tmp_path) == [f"long_class.py:1: class Big, {CLASS_LINES + 1} lines (at most 300)"]
    assert too_long(short, tmp_path) == []
    assert too_long(long_module, tmp_path) == [f"long_module.py: module, {MODULE_LINES + 1} lines (at most 500)"]
