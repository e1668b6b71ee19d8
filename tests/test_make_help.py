"""`make help` (issue 58): every target with its description, the names in one column as wide
as the longest, the descriptions wrapped to the terminal's width, at any width."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = re.findall(r"^([a-z-]+):.*## (.*)$", (ROOT / "Makefile").read_text(), re.M)


def _help(columns: int) -> list[str]:
    env = {**os.environ, "COLUMNS": str(columns)}
    r = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize("columns", [200, 100, 80, 60])
def test_every_line_fits_and_every_word_of_every_description_is_there(columns):
    lines = _help(columns)
    assert max(len(line) for line in lines) <= columns
    names = [m.group(1) for line in lines if (m := re.match(r"  make (\S+)", line))]
    assert names == [name for name, _ in DOCUMENTED]
    assert " ".join(" ".join(line.split()) for line in lines).split() == [
        word for name, text in DOCUMENTED for word in ("make", name, *text.split())
    ]


def test_the_names_column_is_as_wide_as_the_longest_name():
    longest = max(len(name) for name, _ in DOCUMENTED)
    assert longest > 12  # stack-tensorboard: the old 12-character column ran its description into it
    firsts = [line for line in _help(200) if line.startswith("  make ")]
    column = {line.index(text.split()[0], 7 + len(name)) for line, (name, text) in zip(firsts, DOCUMENTED)}
    assert column == {len("  make ") + longest + 1}


def test_a_narrow_terminal_puts_each_description_under_its_name():
    lines = _help(40)
    assert lines[0] == "  make help" and lines[1] == "      list the targets"
    assert max(len(line) for line in lines) <= 40
