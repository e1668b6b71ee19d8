"""Words for one-line messages: an error's first line, a count and its noun."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """What an error says, in one line: its first non-empty line that is not torch's
    `On WorkerInfo(...)` preamble, else the exception's type name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("On WorkerInfo")]
    return lines[0] if lines else type(error).__name__


def counted(count: int, noun: str, plural: str = "") -> str:
    """`1 worker`, `3 workers`: a count and its noun for a log line (`plural` when not noun + s)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
