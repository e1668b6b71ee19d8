"""`Check`, and the checks every engine target shares: pure functions of (topology, facts).

A check returns one `Check`: ok, a problem with how to fix it, not checked (something it
needs failed above), or not run (by choice). The GPU helpers here read what an engine
reports (`docker info`) and are shared by the compose checks and `gpu-check`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from orchestrator import sample_data
from orchestrator.doctor.facts import CDI_GPU_KIND, Facts
from orchestrator.hints import command
from orchestrator.render.holder import shares_pid_namespace
from orchestrator.render.shm_sizing import exchange_estimate, shared_shm_bytes
from orchestrator.topology.model import Topology, size_bytes
from orchestrator.topology.services import has_ps

MIN_API = (1, 40)  # Docker 19.03: GPU device requests; Swarm's cap_drop needs 1.41 (20.10)
GIB = 1024**3
# Free disk under the daemon's root dir that an image build needs (layers, build cache),
# the same when its base image is there already (only the app's layers, ~60 MB, are new),
# and the headroom a run needs when the image is already there (logs, checkpoints).
DISK_FOR_BUILD = {"cpu": 4 * GIB, "cuda": 20 * GIB}
DISK_FOR_RUN = 1 * GIB
DISK_FOR_LAYERS = DISK_FOR_RUN + GIB // 4
SHM_FOR_LOADER = 256 * 1024**2  # DataLoader worker processes pass batches through /dev/shm
NVIDIA_FIX = (
    "install the NVIDIA Container Toolkit, then `sudo nvidia-ctk runtime configure --runtime=docker "
    "&& sudo systemctl restart docker`"
)
DRIVER_FIX = "install the NVIDIA driver (`nvidia-smi -L` lists the GPUs)"


@dataclass(frozen=True)
class Check:
    name: str
    ok: Optional[bool]  # None: not checked (something it needs failed above)
    text: str
    fix: str = ""
    ran: bool = True  # False (with ok True): not run by choice or not yet possible; `text` says why

    @property
    def passed(self) -> bool:
        return self.ok is True and self.ran

    @property
    def not_run(self) -> bool:
        return self.ok is True and not self.ran

    def line(self) -> str:
        status = "not run" if self.not_run else {True: "ok", False: "PROBLEM", None: "skipped"}[self.ok]
        fix = f" -> fix: {self.fix}" if self.ok is False and self.fix else ""
        return f"{status:<8} {self.name:<13} {self.text}{fix}"


CheckFn = Callable[[Topology, Facts], Check]


def run_checks(checks: list[CheckFn], t: Topology, f: Facts) -> list[Check]:
    """Every check of a target's list, in its order."""
    return [check(t, f) for check in checks]


# --- the shared checks ------------------------------------------------------


def check_daemon(t: Topology, f: Facts) -> Check:
    if f.daemon_error is not None:
        return Check(
            "daemon",
            False,
            f"cannot reach the Docker daemon at {f.docker_host} ({f.daemon_error})",
            "start it (`sudo systemctl start docker`, or `make engine`), or fix DOCKER_HOST",
        )
    version = f.info.get("ServerVersion", "?")
    api = _api(f.api_version)
    if api is not None and api < MIN_API:
        return Check(
            "daemon",
            False,
            f"Docker {version} (API {f.api_version}) is too old; need API >= 1.40",
            "install Docker 20.10 or newer",
        )
    return Check("daemon", True, f"Docker {version} (API {f.api_version or '?'}) at {f.docker_host}")


def check_shm(t: Topology, f: Facts, where: str = "/dev/shm", one_host: bool = True) -> Check:
    """The /dev/shm the job's containers are given, against the host's memory. On one host
    with `network.same_host_copy` they share one (orchestrator.render.shm_sizing): the PS's
    shared-memory segments for the exchange are in it too, and said."""
    ps, worker = size_bytes(t.ps.shm_size), size_bytes(t.workers.shm_size)
    if t.train.loader_workers != "auto" and t.train.loader_workers and worker < SHM_FOR_LOADER:
        return Check(
            "shm",
            False,
            f"workers.shm_size {t.workers.shm_size} is too small for {t.train.loader_workers} DataLoader worker(s)",
            "set workers.shm_size to 256m or more (2g for ImageNet-sized batches)",
        )
    shared = one_host and shares_pid_namespace(t)
    total = shared_shm_bytes(t) if shared else (ps if has_ps(t) else 0) + t.workers.count * worker
    what = f"{where}: {gib(total)} in all"
    if shared and not has_ps(t):
        what = f"{where}, one for the job: {gib(total)} in all"
    elif shared:
        exchange = exchange_estimate(t)
        what = f"{where}, one for the job: {gib(total)} in all, " + (
            f"{gib(exchange)} of it the exchange's shared memory ({t.train.model}, {t.max_workers} workers)"
            if exchange is not None
            else f"the exchange's shared memory for {t.train.model} out of ps.shm_size (the PS logs its size)"
        )
    mem = f.info.get("MemTotal")
    if not mem:
        return Check("shm", None, f"{what}; not checked against memory: no daemon")
    if total > mem:
        return Check(
            "shm",
            False,
            f"{what} ({f'ps {t.ps.shm_size} + ' if has_ps(t) else ''}"
            f"{t.max_workers if shared else t.workers.count} x {t.workers.shm_size}) is more than the host's "
            f"{gib(mem)} of memory",
            "lower workers.shm_size / ps.shm_size, or run fewer workers per host",
        )
    return Check("shm", True, f"{what}; host memory {gib(mem)}")


def check_data(t: Topology, f: Facts, where: str = "") -> Check:
    """`where`: what the target adds to a readable data dir (e.g. every node needs it)."""
    if not t.reads_files:
        what = "your code reads no train.data_dir" if ":" in t.train.dataset else "ships in a package"
        return Check("data", True, f"not needed (dataset {t.train.dataset}: {what})")
    if t.data_source() is None:
        return Check("data", True, f"{t.train.data_dir}: a URL, read by the job's processes as given")
    if f.data_problem is not None:
        sample = Path(t.data_dir()).resolve() == Path(sample_data.DEFAULT_OUT).resolve()
        return Check(
            "data",
            False,
            f"train.data_dir: {t.train.data_dir} {f.data_problem} (dataset {t.train.dataset} reads it)",
            f"{command('sample-data')} writes it" if sample else "put the data there, or change train.data_dir",
        )
    return Check("data", True, f"{f.data_dir} readable{'; ' + where if where else ''}")


def check_disk(t: Topology, f: Facts) -> Check:
    if f.daemon_error is not None:
        return Check("disk", None, "not checked: no daemon")
    if f.disk_free is None:
        return Check("disk", True, "free space not checked (the daemon is not on this host)")
    if f.image_present:
        need, why = DISK_FOR_RUN, f"image {t.image_tag} present"
    elif f.base_present:
        need, why = DISK_FOR_LAYERS, f"image {t.image_tag} to build on {t.image.base}, which is present"
    else:
        need, why = DISK_FOR_BUILD[t.image.device], f"image {t.image_tag} to build"
    root = f.info.get("DockerRootDir", "Docker's root dir")
    if f.disk_free < need:
        return Check(
            "disk",
            False,
            f"{gib(f.disk_free)} free under {root}; {why}: need {gib(need)}",
            "free space (`docker image prune`, remove old images) or move Docker's data-root",
        )
    return Check("disk", True, f"{gib(f.disk_free)} free under {root} ({why}, need {gib(need)})")


def check_port(t: Topology, f: Facts) -> Check:
    port = t.ps.rpc_port
    if not t.network.publish_rpc_port:
        return Check("rpc port", True, f"{port} not published: reachable only on the cluster's private network")
    if f.port_in_use:
        return Check(
            "rpc port",
            False,
            f"{port} is published (network.publish_rpc_port) but already in use on this host",
            "stop what listens on it, or choose another ps.rpc_port",
        )
    return Check(
        "rpc port",
        True,
        f"{port} published on every host address: a connection must prove the run's secret before a message "
        "is read, yet anyone may try and load the PS: firewall it (network.publish_rpc_port: false keeps it private)",
    )


# --- GPUs as an engine reports them -------------------------------------------


def gpu_paths(f: Facts) -> list[str]:
    """Every way this engine can honour compose's `driver: nvidia` device request (empty: none).

    Any one suffices: the `nvidia` runtime registered; CDI devices nvidia.com/gpu=* the
    engine discovered (API >= 1.50), or a CDI spec for them in its CDISpecDirs; an NVIDIA
    hook on the daemon's host (moby registers the `nvidia` driver then); Docker Desktop's
    WSL 2 backend (GPU paravirtualisation, no runtime)."""
    info = f.info
    paths = []
    if "nvidia" in (info.get("Runtimes") or {}):
        paths.append("the nvidia runtime")
    devices = cdi_gpus(info)
    if devices:
        paths.append(f"CDI devices {CDI_GPU_KIND}={','.join(devices)}")
    elif f.cdi_specs:
        paths.append(f"the CDI spec {f.cdi_specs[0]}")
    if f.hooks:
        paths.append(" and ".join(f.hooks) + " on the daemon's host")
    if docker_desktop_wsl(info):
        paths.append("Docker Desktop's WSL 2 GPU support")
    return paths


def cdi_gpus(info: dict[str, Any]) -> list[str]:
    """The names (after `nvidia.com/gpu=`) of the CDI GPU devices the engine reports."""
    out = []
    for d in info.get("DiscoveredDevices") or []:
        ident = str((d or {}).get("ID") or "")
        if (d or {}).get("Source") == "cdi" and ident.startswith(CDI_GPU_KIND + "="):
            out.append(ident.split("=", 1)[1])
    return out


def docker_desktop_wsl(info: dict[str, Any]) -> bool:
    return (
        info.get("OperatingSystem") == "Docker Desktop"
        and "microsoft-standard-wsl2" in str(info.get("KernelVersion", "")).lower()
    )


def wanted_gpus(t: Topology) -> list[int]:
    """The host GPU ids the topology reserves (workers.gpus and ps.gpu), sorted."""
    ps = t.ps_gpu()
    return sorted(set(t.worker_gpus() + ([ps] if ps is not None else [])))


def host_gpus(f: Facts) -> tuple[Optional[list[int]], str]:
    """This host's GPU ids and where they came from: `nvidia-smi -L`, else the engine's CDI
    devices named by index; (None, "") when neither tells."""
    if f.gpus is not None:
        return f.gpus, "nvidia-smi -L"
    indices = sorted(int(n) for n in cdi_gpus(f.info) if n.isdigit())
    if indices:
        return indices, "the engine's CDI devices"
    return None, ""


def _api(text: str) -> Optional[tuple[int, int]]:
    m = re.match(r"^(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"
