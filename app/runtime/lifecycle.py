"""How a process ends: SIGTERM (handled, deferred over a push, a grace period), deadlines, cleanups, a hard exit."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from app.runtime.logs import log
from app.runtime.words import first_line


def handle_sigterm(grace: float, announce: bool = True) -> None:
    """SIGTERM ends the process even as PID 1 and even while blocked inside torch.

    Python runs signal handlers only between bytecodes of the main thread,
    which may sit in a C++ wait (rendezvous, an RPC). The handler raises
    SystemExit for the normal path; a watcher thread, woken through the
    signal wakeup fd, ends the process with 143 if it is still alive `grace`
    seconds later (`announce`: it says so in one line as the signal comes).
    While `sigterm_exits_at_once` holds a line, the watcher ends the process
    at once with that line and status 0 instead.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, _raise_exit)
    threading.Thread(
        target=_exit_after_sigterm, args=(read_fd, grace, announce), name="sigterm-watch", daemon=True
    ).start()


class _Sigterm:
    deferring = False  # inside `sigterm_deferred`
    pending = False  # a SIGTERM came meanwhile
    received = False  # a SIGTERM came at all
    at_once = ""  # `sigterm_exits_at_once`'s line
    farewell: Callable[[], object] | None = None  # and what it does first
    lock = threading.Lock()  # `at_once` against the watcher's reading of it


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    _Sigterm.received = True
    if _Sigterm.deferring or _Sigterm.at_once:  # the watcher ends the process (at_once) or the block raises
        _Sigterm.pending = True
        return
    raise SystemExit(128 + signum)


def sigterm_received() -> bool:
    """Whether this process was told to stop (SIGTERM)."""
    return _Sigterm.received


def sigterm_exits_at_once(line: str, farewell: Callable[[], object] | None = None) -> None:
    """From now on a SIGTERM ends the process at once with status 0 and `line` (logged), even
    while the main thread waits inside torch: for a stretch with nothing to hand over or undo
    (a worker that has not joined its job yet). `farewell`: called first (a worker telling its
    PS not to wait for it); the main thread goes no further meanwhile. '' ends that stretch; a
    SIGTERM that came in it and did not end the process raises SystemExit here (or at the end
    of the enclosing `sigterm_deferred`)."""
    with _Sigterm.lock:
        _Sigterm.at_once, _Sigterm.farewell = line, farewell if line else None
    if not line and _Sigterm.pending and not _Sigterm.deferring:
        _Sigterm.pending = False
        raise SystemExit(128 + signal.SIGTERM)


@contextmanager
def sigterm_deferred() -> Iterator[None]:
    """A SIGTERM during the block takes effect (SystemExit) at its end, so the block's
    state changes happen all or none (a step and the step count that labels it).
    The watcher thread's hard exit still comes `grace` seconds after the signal."""
    _Sigterm.deferring = True
    try:
        yield
    finally:
        _Sigterm.deferring = False
        if _Sigterm.pending:
            _Sigterm.pending = False
            raise SystemExit(128 + signal.SIGTERM)


def _exit_after_sigterm(read_fd: int, grace: float, announce: bool) -> None:
    while signal.SIGTERM not in os.read(read_fd, 64):
        pass
    _Sigterm.received = True
    with _Sigterm.lock:
        if _Sigterm.at_once:
            if _Sigterm.farewell is not None:
                try:
                    _Sigterm.farewell()
                except Exception as error:  # noqa: BLE001 - on the way out: say it, and go
                    log.warning("on SIGTERM: %s", first_line(error))
            log.info("%s", _Sigterm.at_once)
            exit_now(0)
    if announce:
        log.info("SIGTERM: stopping (at most %.0f s)", grace)
    time.sleep(grace)
    _hard_exit(f"still running {grace:.0f} s after SIGTERM", 128 + signal.SIGTERM)


@contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """End the process with status 1 and one line if the block outlives `seconds`."""
    timer = threading.Timer(seconds, _hard_exit, args=(f"{what} did not finish within {seconds:.0f} s", 1))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


_CLEANUPS: list[Callable[[], None]] = []


def on_exit(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` when this process ends, however it ends short of SIGKILL: its role
    returning or raising (app.__main__), SIGTERM, or `exit_now`'s hard exit."""
    _CLEANUPS.append(cleanup)


def run_cleanups() -> None:
    """Run the `on_exit` cleanups, newest first, each once; a failing one is logged."""
    while _CLEANUPS:
        cleanup = _CLEANUPS.pop()
        try:
            cleanup()
        except Exception as error:  # the process is ending: say it, and go on with the others
            log.warning("cleanup at exit failed: %s", first_line(error))


def _hard_exit(message: str, status: int) -> None:
    log.error("%s; exiting with status %d", message, status)
    exit_now(status)


def exit_now(status: int) -> None:
    """End the process at once, its `on_exit` cleanups run and logs and stdout flushed (no
    interpreter teardown)."""
    run_cleanups()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
