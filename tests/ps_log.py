"""Reading the PS's log in tests, as processes (`ps      | ...` from `orchestrator local`)
and as a container's own log."""

from __future__ import annotations

import re

_ACCURACY = re.compile(r"(?:^|\| )(?:ps \| Update: \d+ \| )?Accuracy: ([0-9.]+)$", re.MULTILINE)


def last_evaluations(ps_log: str, count: int = 3) -> list[float]:
    """The PS's last `count` held-out accuracies: its periodic `Update: N | Accuracy: A`
    lines, then the final `Accuracy: A`."""
    return [float(a) for a in _ACCURACY.findall(ps_log)[-count:]]
