"""An allreduce job's rendezvous on one host with no TCP listener: c10d's FileStore in the job's
private directory (--socket_dir: 0700 and the job's user's; in compose the `exchange` tmpfs that
only the job's containers mount), where the kernel refuses every other account.

c10d's TCPStore listens on every address of its host and has no authentication; a FileStore is
a file. A file outlives a killed job, though (the app leaves with os._exit, so no destructor
removes it), and a restarted job that read the last attempt's keys would wait for ranks long
gone. So each life of rank 0 makes a store of its own:

    rank 0: a fresh directory `rendezvous-<random>/` holding `alive` (flocked, exclusive, for
        the process's whole life: the kernel drops the lock when the process ends, however it
        ends) and `store` (the FileStore); the last attempts' directories removed; then the
        link `rendezvous` pointed at it (an atomic rename).
    another rank: follows the link and uses the store it finds only while that store's `alive`
        is locked (its own shared, non-blocking flock fails); a stale one (rank 0 gone) is
        waited past until rank 0 publishes a new one or `deadline`.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile
import time

from app.exchange.transport import private_directory

LINK = "rendezvous"
PREFIX = "rendezvous-"
ALIVE = "alive"
STORE = "store"
POLL_S = 0.1

_HELD: list[int] = []  # rank 0's locks: open (and so held) until the process ends


def publish(directory: str) -> str:
    """Rank 0: a fresh store for this life of the process, published; its path."""
    private_directory(directory)
    for old in glob.glob(os.path.join(glob.escape(directory), PREFIX + "*")):
        shutil.rmtree(old, ignore_errors=True)  # an earlier attempt's: its rank 0 is gone
    fresh = tempfile.mkdtemp(prefix=PREFIX, dir=directory)  # 0700
    alive = os.open(os.path.join(fresh, ALIVE), os.O_RDONLY | os.O_CREAT, 0o600)
    fcntl.flock(alive, fcntl.LOCK_EX)
    _HELD.append(alive)
    temp = os.path.join(directory, f".{LINK}.{os.getpid()}")
    if os.path.lexists(temp):
        os.unlink(temp)
    os.symlink(os.path.basename(fresh), temp)
    os.replace(temp, os.path.join(directory, LINK))
    return os.path.join(fresh, STORE)


def find(directory: str, deadline: float) -> str:
    """Another rank: the path of the store rank 0 published in its present life, once there is
    one; TimeoutError when none is by `deadline` (time.monotonic)."""
    while True:
        try:
            fresh = os.path.join(directory, os.readlink(os.path.join(directory, LINK)))
            if alive(os.path.join(fresh, ALIVE)):
                return os.path.join(fresh, STORE)
        except OSError:  # not published yet, or removed by a new rank 0 as we looked
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"rank 0 published no live rendezvous in {directory}")
        time.sleep(POLL_S)


def alive(path: str) -> bool:
    """Whether the process that made the store beside `path` still holds its lock."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)  # drops the shared lock when it was taken
    return False
