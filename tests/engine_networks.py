"""Who may use the host engine's bridge networks while `docker swarm leave` runs: nobody.

`docker swarm leave` drops the embedded DNS records of every bridge network that exists at
that moment (moby/moby#45144; seen on Docker 20.10.24): a container there no longer resolves
its project's other services by name, for the rest of the network's life, restarts included
("cannot resolve ps" from every worker of a compose project, until its test timed out). A
network made after the leave resolves again.

So the test that leaves a swarm it made (tests/containers/test_swarm_stack.py) does so only
while no other pytest-xdist worker has a compose project on this engine:

- `using_networks()`: a shared hold, for as long as a test (or a module fixture) keeps a
  project up on the host engine; several at once, across processes.
- `alone_on_networks()`: the one exclusive hold, around the leave: it waits for the holders
  of the moment to finish, and new holders wait for it (a gate, so a stream of tests one after
  the other cannot starve it).

The locks are flock(2)s on two files in the temporary directory, which every worker of one
`make test` shares. One process may take shared holds inside each other (they count); asking
for the exclusive hold while holding a shared one would wait on itself, and raises instead.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK = Path(tempfile.gettempdir()) / "ps-compose-tests-engine-networks.lock"
GATE = LOCK.with_suffix(".gate")
WAIT_S = 900.0  # the longest a leave waits for the tests of the moment (the longest test: ~5 min)

_held = {"count": 0, "fd": -1}  # this process's shared hold: how many, on which descriptor


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)


@contextmanager
def using_networks() -> Iterator[None]:
    """Hold the host engine's networks in use (shared) while the block runs."""
    if _held["count"] == 0:
        gate, fd = _open(GATE), _open(LOCK)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)  # behind a leave that is waiting
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(gate)  # closing drops its lock
        _held["fd"] = fd
    _held["count"] += 1
    try:
        yield
    finally:
        _held["count"] -= 1
        if _held["count"] == 0:
            os.close(_held["fd"])
            _held["fd"] = -1


@contextmanager
def alone_on_networks(wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold the host engine's networks alone (exclusive) while the block runs; TimeoutError
    when others still hold them after `wait_s`."""
    if _held["count"]:
        raise RuntimeError("this process holds the engine's networks in use: the exclusive hold would wait on itself")
    gate, fd = _open(GATE), _open(LOCK)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"other tests still use the engine's networks after {wait_s:.0f} s") from None
                time.sleep(0.5)
        yield
    finally:
        os.close(fd)
        os.close(gate)
