"""Every repository path a file cites (`app/...`, `orchestrator/...`, `docs/...`, ...) exists:
a docstring or a doc that names a moved file fails here, not in a reader's hands."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"(?<![\w/.-])((?:app|orchestrator|bench|tests|docs|images|configs|examples)/[\w./-]*\w)")
# Placeholders and files made at run time, not paths in the tree.
NOT_PATHS = {
    "configs/X.yaml",
    "configs/x.yaml",
    "configs/gpu.yaml",
    "docs/topology.md.tmp",
    "configs/topology.schema.json.tmp",
    "images/s",
    "images/wheelhouse",
    "images/wheelhouse-tracking",  # the MLflow server's wheels, made by its first build (gitignored)
    "images/.cache",  # the debootstrap cache and build logs, made by the first build (gitignored)
    "examples/wordlm/data",  # the corpus examples/wordlm/make_data.py writes (gitignored)
    "images/.cache/packages",  # image.packages' resolutions and wheels, made by a build that has some (gitignored)
}


def cited() -> dict[str, list[str]]:
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "Makefile", "*.sh", "*.yaml", "*.toml"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.split()
    found: dict[str, list[str]] = {}
    for name in files:
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        for m in CITED.finditer(text):
            path = m.group(1).rstrip(".")
            if "*" not in path and "<" not in path and path not in NOT_PATHS:
                found.setdefault(path, []).append(name)
    return found


def test_every_cited_path_exists() -> None:
    missing = {p: sorted(set(fs)) for p, fs in cited().items() if not (ROOT / p).exists()}
    assert not missing, "\n".join(f"{p} (cited by {', '.join(fs)})" for p, fs in sorted(missing.items()))


def test_the_citations_are_found() -> None:
    found = cited()
    assert "orchestrator/render/compose.py" in found and "docs/design.md" in found
