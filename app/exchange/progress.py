"""How far the PS has written a reply buffer: one 32-bit word of the segment's header per region
(app.exchange.segment), which the PS raises as it finishes each partition of a new state, and
which a worker on its host waits on before its forward reads that partition (a Linux futex on
the shared mapping: the waiter sleeps in the kernel, nothing polls).

The word counts the partitions written into its region since the segment was made, modulo
2**32: a streamed reply says the count before its update (`base`), so partition j of it is
written once the word has passed base + j + 1. Only the PS process writes a word; a worker
only reads it and waits.

Where the word says a partition is written, its values are there for the reader: on x86-64
stores become visible in program order (and the copies that bypass the cache end with a fence
before they return), so the store of the word follows the partition's. Elsewhere (`available`
is False) no reply is streamed, and a worker reads a reply once it has come whole.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import time

MASK = 0xFFFFFFFF
_SYS_FUTEX = 202  # x86-64 Linux
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the word is in a mapping of several processes
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def available() -> bool:
    """Whether replies may be streamed here (Linux on x86-64: futexes, and stores seen in order)."""
    return _LIBC is not None


def _futex(address: int, op: int, value: int, timeout: _Timespec | None = None) -> int:
    assert _LIBC is not None
    pointer = ctypes.byref(timeout) if timeout is not None else None
    signed = value - (1 << 32) if value >= 1 << 31 else value  # the word's bits, as the C int the call takes
    return _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(address), op, ctypes.c_int(signed), pointer, None, 0)


def passed(word: int, base: int, count: int) -> bool:
    """Whether a word reading `word` has counted `count` partitions past `base` (modulo 2**32)."""
    return count <= (word - base) & MASK < 1 << 31


class Progress:
    """The PS's side of one region's word: `publish` counts one more partition written and wakes
    whoever waits on it."""

    def __init__(self, address: int) -> None:
        self.address = address
        self._word = ctypes.c_uint32.from_address(address)
        self.count = self._word.value  # only this process writes it: it goes on from where it is

    def publish(self) -> None:
        self.count = (self.count + 1) & MASK
        self._word.value = self.count
        _futex(self.address, _FUTEX_WAKE, _WAKE_ALL)


def wait_until(address: int, base: int, count: int, timeout: float) -> bool:
    """Sleep until the word at `address` has counted `count` partitions past `base`; False when
    `timeout` seconds passed first."""
    word = ctypes.c_uint32.from_address(address)
    deadline = time.monotonic() + timeout
    while True:
        seen = word.value
        if passed(seen, base, count):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        whole = int(left)
        if _futex(address, _FUTEX_WAIT, seen, _Timespec(whole, int((left - whole) * 1e9))) != 0:
            code = ctypes.get_errno()
            if code not in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT):
                raise OSError(code, os.strerror(code))
