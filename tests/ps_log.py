"""Reading the PS's log in tests, as processes (`ps      | ...` from `orchestrator local`)
and as a container's own log."""

from __future__ import annotations

import re

# the periodic line ends with the run's progress (` | step N of T (P%), S samples/s, ETA H:MM:SS`)
_ACCURACY = re.compile(r"(?:^|\| )(?:ps \| Update: \d+ \| )?Accuracy: ([0-9.]+)(?: \| (?:lr|step) .*)?$", re.MULTILINE)


def last_evaluations(ps_log: str, count: int = 3) -> list[float]:
    """The PS's last `count` held-out accuracies: its periodic `Update: N | Accuracy: A | step
    ...` lines, then the final `Accuracy: A`."""
    return [float(a) for a in _ACCURACY.findall(ps_log)[-count:]]
