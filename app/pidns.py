"""`python -m app.pidns`: hold a compose cluster's shared PID namespace while the job runs.

With `network.same_host_copy` the PS, its shards and the workers join the PID and IPC namespaces
of one `pidns` service (the rendered compose file), so the PS's shared memory for the exchange is
every worker's. That service runs tini as PID 1 and this loop beside it:
it waits until a process of the job appears, then exits 0 once none has been left for `grace`
seconds, so a finished job's containers all end exited 0; a container that restarts in the
meantime (a crashed PS or worker) keeps the namespace alive. SIGTERM (`make down`) ends it at once.
Standard library only: it needs no torch.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

POLL_S = 1.0
GRACE_S = 5.0


def others(proc: Path = Path("/proc"), own: frozenset[int] = frozenset()) -> list[int]:
    """Pids of the namespace's processes that are not PID 1 (tini) nor one of `own`."""
    pids = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            pid = int(entry.name)
            if pid != 1 and pid not in own:
                pids.append(pid)
    return pids


def hold(
    poll: float = POLL_S,
    grace: float = GRACE_S,
    proc: Path = Path("/proc"),
    own: frozenset[int] | None = None,
    clock=time.monotonic,
    sleep=time.sleep,
) -> int:
    """Wait for the job's processes to come and then to be gone for `grace` seconds; 0."""
    own = frozenset({os.getpid()}) if own is None else own
    last_seen: float | None = None
    while True:
        if others(proc, own):
            last_seen = clock()
        elif last_seen is not None and clock() - last_seen >= grace:
            return 0
        sleep(poll)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    print("pidns: holding the job's PID namespace until its processes have left", flush=True)
    code = hold()
    print(f"pidns: every process of the job left {GRACE_S:.0f} s ago; exiting", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
