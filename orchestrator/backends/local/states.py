"""What a local run's launcher says of its processes, for the blocks read from elsewhere:
runs/<name>/local-state.json, written whole (a rename) on every change.

{"launcher": PID, "services": {NAME: {"pid": PID, "status": "running" | "restarting" | "exited",
"exit_code": the last exit status or null, "restarts": times started again}}}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

STATE_FILE = "local-state.json"
LOG_FILE = "local.log"  # a launcher started by the local target's deploy writes its output here


def write(run_dir: Path, launcher: int, services: dict[str, dict[str, Any]]) -> None:
    """Replace the state file of `run_dir` (owner-only, as the run's other files)."""
    path = run_dir / STATE_FILE
    part = path.with_name(f".{STATE_FILE}.{os.getpid()}")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"launcher": launcher, "services": services}, f)
    os.replace(part, path)


def read(run_dir: Path) -> Optional[dict[str, Any]]:
    """The state file of `run_dir`; None when there is none or it cannot be read."""
    try:
        data = json.loads((run_dir / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        return None
    return data
