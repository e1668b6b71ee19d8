"""A signal to the app of one container: what the kernel's OOM killer or a segfault does to a
service, for chaos and for `Backend.signal_app`.

A Python snippet run inside the container (as its user) sends the signal to the `python -m app
ROLE` process of that container. Its cgroup tells it from the other containers' processes,
which it also sees when the job's containers share one PID namespace (network.same_host_copy).
`docker kill` would not do for SIGKILL: Docker counts it as a manual stop and never restarts
the container after it (checked on Docker 20.10).
"""

from __future__ import annotations

import time
from typing import Any


def signal_app_code(signal_name: str = "SIGKILL") -> str:
    """The Python source that sends `signal_name` to the app process of the container it runs in."""
    return (
        "import os, signal\n"
        "own = open('/proc/self/cgroup').read()\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
        "        cgroup = open(f'/proc/{pid}/cgroup').read()\n"
        "    except OSError:\n"
        "        continue\n"
        "    if argv[1:3] == [b'-m', b'app'] and int(pid) != os.getpid() and cgroup == own:\n"
        f"        os.kill(int(pid), signal.{signal_name})\n"
    )


KILL_APP = signal_app_code("SIGKILL")


def send(container: Any, signal_name: str) -> float:
    """Send `signal_name` to the app of `container` (the SDK's); the unix time just before (what
    it sets off may be recorded before the exec returns). Detached: a container restarts under
    it, and the engine once left the wait for its output open for good (a 600 s test timeout on
    a loaded 2-core CPU VM)."""
    sent = time.time()
    container.exec_run(["python", "-c", signal_app_code(signal_name)], detach=True)
    return sent
