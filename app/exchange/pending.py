"""The calls a process of the job's own transport (app.exchange.node) waits on: each call's
future, whom it went to and when it gives up. Any thread adds and settles; settling is once."""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

from torch.futures import Future


class Pending(NamedTuple):
    future: Future
    to: str
    deadline: float
    what: str


class PendingCalls:
    """The table of calls out, by id, under its own lock."""

    def __init__(self) -> None:
        self._calls: dict[int, Pending] = {}
        self._lock = threading.Lock()

    def add(self, call: int, future: Future, to: str, seconds: float, what: str) -> None:
        with self._lock:
            self._calls[call] = Pending(future, to, time.monotonic() + seconds, what)

    def to_of(self, call: Any) -> str | None:
        """Whom call `call` went to, while it waits; None once settled (or never made)."""
        with self._lock:
            pending = self._calls.get(call) if isinstance(call, int) else None
        return pending.to if pending is not None else None

    def answer(self, call: int, sender: str, value: Any = None, error: str | None = None) -> None:
        """Settle `call` with what `sender` answered; an answer from another peer, or to a call
        already settled (it timed out), is dropped."""
        with self._lock:
            pending = self._calls.get(call)
            if pending is None or pending.to != sender:
                return
            del self._calls[call]
        if error is None:
            pending.future.set_result(value)
        else:
            pending.future.set_exception(RuntimeError(f"{pending.what} failed: {error}"))

    def fail(self, call: int, why: str) -> None:
        with self._lock:
            pending = self._calls.pop(call, None)
        if pending is not None:
            pending.future.set_exception(RuntimeError(f"{pending.what} failed: {why}"))

    def fail_to(self, name: str, why: str) -> None:
        """Fail every call waiting on `name`."""
        with self._lock:
            calls = [c for c, p in self._calls.items() if p.to == name]
        for call in calls:
            self.fail(call, why)

    def fail_all(self, why: str) -> None:
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            self.fail(call, why)

    def expire(self) -> None:
        """Fail the calls past their deadline."""
        now = time.monotonic()
        with self._lock:
            late = [(c, p) for c, p in self._calls.items() if p.deadline <= now]
        for call, pending in late:
            self.fail(call, f"{pending.what} timed out")

    def waiting_on(self) -> set[str]:
        """The names calls wait on."""
        with self._lock:
            return {p.to for p in self._calls.values()}

    def ms_to_next_deadline(self, most: int) -> int:
        """How long the I/O thread may sleep before a call expires, at most `most` ms."""
        with self._lock:
            if not self._calls:
                return most
            soonest = min(p.deadline for p in self._calls.values())
        return max(0, min(most, int((soonest - time.monotonic()) * 1000) + 1))
