"""A mistake said once: the one line of an error that fails a process the same way at every start
(exit 2: a bad flag, a plug-in that fails on its first batch), kept where PSC_STOP_FILE says
(app.contract.STOP_FILE_ENV: compose sets it to a file in the container's own filesystem).

Compose restarts a container that fails. A restart of one that stopped on such a mistake finds
the line, says it again with what to do, and exits 0, so the container stays down instead of
failing in a loop; a new run (new containers) starts clean. Without PSC_STOP_FILE (`local`,
which does not restart a process that exits 2) nothing is kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from app.contract import STOP_FILE_ENV

AGAIN = "not retried: this container stopped on it at its first start; fix it and start the run again"


def said_before(env: Mapping[str, str]) -> str:
    """The line a previous start of this container stopped on; '' when none."""
    path = env.get(STOP_FILE_ENV, "")
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as kept:
            return kept.read().strip()
    except OSError:
        return ""


def keep(env: Mapping[str, str], line: str) -> None:
    """Keep `line` for the next start of this container (whole or not at all; a failure to keep
    it costs only the loop it would have saved)."""
    path = env.get(STOP_FILE_ENV, "")
    if not path:
        return
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temp, "w", encoding="utf-8") as out:
            out.write(line + "\n")
        os.replace(temp, path)
    except OSError:
        pass
