"""Processes by id: whether one exists."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether a process `pid` exists (another account's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
