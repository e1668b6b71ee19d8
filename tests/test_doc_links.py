"""Every relative link of README.md and docs/*.md resolves: the file exists, and a `#anchor`
names a heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces as
hyphens, a repeated heading numbered -1, -2...)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*```")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = HEADING.match(line)
        if fenced or not m:
            continue
        a = anchor(m.group(2))
        n = seen.get(a, 0)
        seen[a] = n + 1
        found.add(a if n == 0 else f"{a}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out += [(number, target) for target in LINK.findall(line)]
    return out


def test_the_anchor_rule_is_githubs() -> None:
    assert anchor("A heading (`a/b_c.py`), with: punctuation") == "a-heading-ab_cpy-with-punctuation"
    assert anchor("`scale`: grow or shrink a running cluster") == "scale-grow-or-shrink-a-running-cluster"


def test_every_relative_link_and_anchor_in_the_docs_resolves() -> None:
    broken = []
    for doc in DOCS:
        for number, target in links(doc):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, fragment = target.partition("#")
            dest = doc if not file else (doc.parent / file).resolve()
            where = f"{doc.relative_to(REPO)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{where}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not broken, "\n".join(broken)
