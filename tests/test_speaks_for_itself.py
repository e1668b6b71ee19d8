"""The project speaks for itself: no tracked file outside tests/ points at things a reader
of the published project does not have (the documents it was built from, issue numbers,
a sibling `../shared` directory, "this machine", dated log lines). Figures name the
machine they were measured on instead ("a 2-core CPU VM")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PATTERNS = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\bseeds? 0\d\d",  # "seed 000", "seeds 001-003"
        r"\bseeds? \d{3}\b",
        r"\bseed's\b",
        r"\bsource documents?\b",
        r"\bissues? #?\d+",  # "issue 5", "issue #6"
        r"\.\./shared",
        r"\bthis machine\b",
        r"\bthis (?:\d+|one|two)-core\b",  # "this 2-core machine"
        r"\b\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}",  # a dated log line
    )
]


def _hits(include_app: bool) -> list[str]:
    """file:line: text of every match in the tracked text files outside tests/ (app/ only if asked)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    out = []
    for name in files:
        if name.startswith("tests/") or name.startswith("app/") != include_app:
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary (images), or deleted in the work tree
        for number, line in enumerate(text.splitlines(), 1):
            if any(p.search(line) for p in PATTERNS):
                out.append(f"{name}:{number}: {line.strip()}")
    return out


def test_patterns_catch_what_they_are_for():
    for text in (
        "Seed 000's run",
        "seeds 001-003",
        "the seed's model",
        "(issue 5)",
        "issue #12",
        "../shared/seeds/",
        "on this machine",
        "this 2-core machine",
        "the source documents",
        "2026-11-22 04:14:40,782 INFO app.ps",
    ):
        assert any(p.search(text) for p in PATTERNS), text
    for text in ("--seed 0", "seed: 0", "pytorch/pytorch#95487", "a 2-core CPU VM", "issued to"):
        assert not any(p.search(text) for p in PATTERNS), text


def test_no_file_outside_tests_and_app_names_what_a_reader_does_not_have():
    hits = _hits(include_app=False)
    assert not hits, "these lines refer to documents, issues or machines the reader does not have:\n" + "\n".join(hits)


def test_no_file_in_app_names_what_a_reader_does_not_have():
    hits = _hits(include_app=True)
    assert not hits, "these lines refer to documents, issues or machines the reader does not have:\n" + "\n".join(hits)
