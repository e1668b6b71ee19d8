"""The errors the CLI turns into exit statuses, and the one-line wording of Docker's.

`UsageError`: bad input (a flag, a config, a path), exit status 2.
`EngineError`: the Docker engine or compose is missing, unreachable or failed,
exit status 1. Both carry a message of one line (a failed build may add the
failing step's output below it).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any


class UsageError(Exception):
    """Bad input from the user (a flag, a config, a path): exit status 2.

    The message is one line, printed after ``error: `` on stderr.
    """


class EngineError(RuntimeError):
    """The Docker engine or compose is missing or unreachable (exit status 1)."""


def engine_errors(fn: Callable[..., int]) -> Callable[..., int]:
    """An EngineError (no daemon, no compose, a failed build) is one line and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> int:
        try:
            return fn(*args, **kwargs)
        except EngineError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    return wrapper


def one_line(e: BaseException) -> str:
    """An exception's text with every run of whitespace made one space."""
    return " ".join(str(e).split())


_DAEMON_REASONS = (
    ("FileNotFoundError", "no socket"),
    ("No such file", "no socket"),
    ("ConnectionRefused", "connection refused"),
    ("Connection refused", "connection refused"),
    ("PermissionError", "permission denied"),
    ("Permission denied", "permission denied"),
    ("timed out", "timed out"),
    ("Name or service not known", "unknown host"),
)


def daemon_reason(e: BaseException) -> str:
    """Why the Docker daemon did not answer, in a few words (else the error's first 160 characters)."""
    text = one_line(e)
    for marker, reason in _DAEMON_REASONS:
        if marker in text:
            return reason
    return text[:160]


def last_line(text: str) -> str:
    """The last non-blank line of a command's output ('' when there is none)."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""
