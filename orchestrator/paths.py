"""Where things are in the repository, for the verbs that read or write its files."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository (the compose project directory)
RUNS = ROOT / "runs"
DOCKERFILE = "images/Dockerfile"  # relative to ROOT, the build context
DEFAULT_CONFIG = "configs/default.yaml"
SMOKE_CONFIG = "configs/cpu-smoke.yaml"


def relative(path: Path) -> str:
    """`path` relative to the repository when it is inside it (for messages)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
