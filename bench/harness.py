"""What every bench command does around its cases: the machine it ran on, each case tried with
its failure kept (one failed case is reported, the others stand), the closing lines and the
`--json` file."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def machine() -> dict[str, Any]:
    """Where the figures come from: cores this process may use, torch, the load average."""
    import torch

    return {
        "cores": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_start": os.getloadavg(),
    }


def attempt(prog: str, label: str, fn: Callable[[], T], failures: list[str]) -> T | None:
    """`fn()`, announced on stderr as `prog: label ...`; None, with `label: Error: what`
    appended to `failures`, when it raises."""
    print(f"{prog}: {label} ...", file=sys.stderr, flush=True)
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - one failed case is reported, the others stand
        failures.append(f"{label}: {type(error).__name__}: {error}")
        print(f"{prog}: {label}: FAILED: {error}", file=sys.stderr, flush=True)
        return None


def run_line(what: str, repeats: int, wall_s: float, where: dict[str, Any]) -> str:
    """The line under a table: what was timed, the repeats, the wall time and the load."""
    start, end = where["loadavg_start"][0], where["loadavg_end"][0]
    return (
        f"\n{what}; {repeats} repeat(s); {wall_s:.0f} s on {where['cores']} cores; "
        f"load average {start:.1f} at the start, {end:.1f} at the end"
    )


def close(text: str, failures: list[str], path: str | None, doc: Callable[[], dict[str, Any]]) -> int:
    """Print `text` and the failures, write `doc()` to `path` when one is given; the exit status
    (1 when a case failed)."""
    print(text)
    if failures:
        print("failed cases:\n  " + "\n  ".join(failures))
    if path:
        write_json(path, doc())
    return 1 if failures else 0


def write_json(path: str, doc: dict[str, Any]) -> None:
    text = json.dumps(doc, indent=2)  # fails here, not half-written, when something is not JSON
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {path}")


def python_path(root: object) -> str:
    """PYTHONPATH for a process the bench starts: the checkout `root` first, then what the
    caller's PYTHONPATH held (a host's own packages, as bench/card/run.sh puts there)."""
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(filter(None, [str(root), inherited]))
