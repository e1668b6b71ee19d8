"""Running one engine command line (`docker compose ...`, `docker stack ...`)."""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Sequence
from typing import Optional

from orchestrator.errors import EngineError, last_line


def run(
    argv: Sequence[str], *, check: bool = True, capture: bool = False, env: Optional[dict[str, str]] = None
) -> subprocess.CompletedProcess[str]:
    """Run one command line (`env`: added to this process's environment, e.g. the run's id
    the rendered file interpolates); EngineError when it fails and `check`."""
    try:
        r = subprocess.run(list(argv), text=True, capture_output=capture, env={**os.environ, **env} if env else None)
    except OSError as e:
        raise EngineError(f"cannot run {argv[0]}: {e.strerror or e}") from None
    if check and r.returncode != 0:
        detail = f": {last_line(r.stderr)}" if capture and last_line(r.stderr) else ""
        raise EngineError(f"`{shlex.join(argv)}` failed with exit status {r.returncode}{detail}")
    return r
