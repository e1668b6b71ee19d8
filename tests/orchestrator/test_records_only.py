"""The app's metrics records are the orchestrator's only input about a run: no orchestrator
module reads the app's log text or the compose file back for a fact (the logs are for
people). The phrases below are what the app prints for people; finding one in the
orchestrator's code means something parses it again."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Lines of the app's logs (app/ps/members/liveness.py, app/training/loop.py, app/ps/process.py,
# app/allreduce/job.py, app/ps/sharding/shard_process.py): each was once matched by an orchestrator module.
APP_LOG_PHRASES = ("Accuracy:", "joined at version", "| Epoch:", "Update:", "resumed from ckpt-", r"\bdropped")
# Reading a rendered compose file back for a setting of the run.
COMPOSE_READ_BACK = ("PSC_STRATEGY", "PSC_BATCH_SIZE")
WRITERS = ("orchestrator/render/", "orchestrator/verbs/check.py", "orchestrator/verbs/local.py")  # they set them


def string_constants(path: Path) -> list[tuple[int, str]]:
    """Every string literal in code (docstrings and f-string text included, comments not)."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def offences() -> list[str]:
    found = []
    for path in sorted((ROOT / "orchestrator").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, text in string_constants(path):
            for phrase in APP_LOG_PHRASES:
                if phrase in text:
                    found.append(f"{rel}:{line}: {phrase!r} in {text[:80]!r}")
            if not rel.startswith(WRITERS):
                found += [f"{rel}:{line}: {name}" for name in COMPOSE_READ_BACK if name in text]
    return found


def test_no_orchestrator_module_parses_the_apps_log_text() -> None:
    bad = offences()
    assert not bad, "the app's records are the input, not its logs:\n" + "\n".join(bad)


def test_the_scan_finds_a_phrase_where_there_is_one(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text('import re\nACC = re.compile(r"^Accuracy:\\s*([0-9.]+)")\n')
    assert [text for _, text in string_constants(sample)] == ["^Accuracy:\\s*([0-9.]+)"]
