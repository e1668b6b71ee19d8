"""What the container may use of its host: CPUs (affinity, cgroup v2 or v1 quota), shared memory, RAM.

The readers return None for what the host does not say (no cgroup v2, no /dev/shm);
the rules (`auto_loader_workers`) are pure functions of the figures, so tests give
them cpu counts and quotas instead of a host.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

LOADER_WORKERS_CAP = 8  # more loader processes than this rarely feed one GPU faster; each holds a copy of torch
CGROUP = Path("/sys/fs/cgroup")


def affinity_cpus() -> int:
    """CPUs this process may run on (sched_getaffinity; os.cpu_count where it does not exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """The cgroup CPU limit in CPUs (e.g. `docker run --cpus`): cgroup v2's `cpu.max`
    (quota / period), else cgroup v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us` under
    cpu/ or cpu,cpuacct/; None when unlimited (`max`, -1) or when neither file is there."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return _cpu_quota_v1(cgroup)
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def _cpu_quota_v1(cgroup: Path) -> float | None:
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        try:
            quota = int((cgroup / controller / "cpu.cfs_quota_us").read_text())
            period = int((cgroup / controller / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def usable_cpus(affinity: int, quota: float | None) -> int:
    """Whole CPUs the container may keep busy: its affinity, lowered to the quota (at least 1)."""
    cpus = affinity if quota is None else min(affinity, math.floor(quota))
    return max(1, cpus)


def auto_loader_workers(
    affinity: int, quota: float | None, host_workers: int, cap: int = LOADER_WORKERS_CAP
) -> tuple[int, str]:
    """(DataLoader processes, why) for `loader_workers: auto`: the container's usable CPUs
    shared among the `host_workers` workers of this host, minus one for the training
    process itself; between 0 and `cap`. 2 CPUs and 2 workers: 0 (load in the training process)."""
    cpus = usable_cpus(affinity, quota)
    share = cpus // max(1, host_workers)
    chosen = min(cap, max(0, share - 1))
    limit = f", cgroup quota {quota:g}" if quota is not None else ""
    why = (
        f"auto: {cpus} CPU(s) (affinity {affinity}{limit}) / {max(1, host_workers)} worker(s) on this host "
        f"= {share}, minus 1 for training, at most {cap}"
    )
    return chosen, why


def loader_workers(setting: str | int, host_workers: int) -> tuple[int, str]:
    """(DataLoader processes, why) for the --loader_workers setting: `auto` or a number."""
    if setting != "auto":
        return int(setting), "set by --loader_workers"
    return auto_loader_workers(affinity_cpus(), cpu_quota(), host_workers)


def shm_free(path: str = "/dev/shm") -> int | None:
    """Free bytes of the shared-memory filesystem (a container's is `shm_size`); None without one."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def memory_available(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = CGROUP) -> int | None:
    """Bytes the process may still allocate: MemAvailable, lowered to the cgroup v2 limit's
    headroom (memory.max - memory.current) when the container has one."""
    available = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            headroom = int(limit) - int((cgroup / "memory.current").read_text())
            available = headroom if available is None else min(available, headroom)
    except (OSError, ValueError):
        pass
    return available
