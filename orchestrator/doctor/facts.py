"""What doctor knows about the host: `Facts`, and `gather`, which asks and never judges.

`gather` asks what every engine target needs (the daemon, its info, the image, free
disk, the GPUs, the data directory, the RPC port); a backend adds what only its target
needs (`Backend.gather_facts`: compose's CLI, the swarm's nodes, kubectl) under
`Facts.target`. Every field has a 'could not tell' value, so a check can say so.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from orchestrator.errors import daemon_reason
from orchestrator.paths import ROOT
from orchestrator.topology.model import Topology

# dockerd registers its `nvidia` device driver when one of these is on its PATH (moby#50228:
# the CDI one first, else the prestart hook); compose's `driver: nvidia` needs no runtime then.
NVIDIA_HOOKS = ("nvidia-cdi-hook", "nvidia-container-runtime-hook")
HOOK_DIRS = ("/usr/bin", "/usr/local/bin", "/usr/sbin", "/usr/local/sbin")
CDI_GPU_KIND = "nvidia.com/gpu"
_GPU_LINE = re.compile(r"^GPU (\d+):", re.MULTILINE)


@dataclass(frozen=True)
class ProbeGPU:
    id: int  # the host GPU id requested (workers.gpus / ps.gpu)
    name: str
    uuid: str


@dataclass(frozen=True)
class Probe:
    """What the probe container saw (`doctor.probe.parse_probe`); `error` set: it did not get that far."""

    requested: list[int]
    gpus: list[ProbeGPU] = field(default_factory=list)
    uid: Optional[int] = None
    denied: list[tuple[str, str, int]] = field(default_factory=list)  # (device node, why, its group id)
    error: str = ""
    fix: str = ""


@dataclass(frozen=True)
class Facts:
    """What `gather` found; every field has a 'could not tell' value."""

    docker_host: str = "unix:///var/run/docker.sock"
    daemon_error: Optional[str] = None  # None: the daemon answered
    info: dict[str, Any] = field(default_factory=dict)
    api_version: str = ""
    gpus: Optional[list[int]] = None  # `nvidia-smi -L` indices; None: no nvidia-smi
    data_dir: Optional[str] = None  # the host path checked, when the dataset reads files
    data_problem: Optional[str] = None  # None: present and readable
    disk_free: Optional[int] = None  # bytes under DockerRootDir; None: remote daemon / unknown
    image_present: bool = False
    base_present: bool = False  # image.base, which the image is built on
    port_in_use: Optional[bool] = None  # the RPC port on this host, when published
    hooks: list[str] = field(default_factory=list)  # NVIDIA_HOOKS found on this host (local daemon only)
    cdi_specs: list[str] = field(default_factory=list)  # files in the engine's CDISpecDirs naming nvidia.com/gpu
    probe: Optional[Probe] = None  # None: not run (--no-probe, `up`'s preflight, no image yet)
    probe_note: str = ""  # why the probe did not run, when asked for
    target: Mapping[str, Any] = field(default_factory=dict)  # what the target's backend found (its own keys)


# A backend's addition: (topology, a Docker client or None, the facts so far, probe asked) -> its facts.
TargetFacts = Callable[[Topology, Any, Facts, bool], dict[str, Any]]


def gather(
    t: Topology, *, client: Any = None, engine: bool = True, probe: bool = False, target: Optional[TargetFacts] = None
) -> Facts:
    """Ask the host. `client`: a Docker client that already answered (else one is made);
    `engine`: False for a target that runs on no local Docker engine; `target`: the
    backend's own questions, asked last, with the facts so far."""
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    facts: dict[str, Any] = {"docker_host": host}
    if engine:
        client = _engine_facts(t, client, host, facts)
    else:
        client = None
    if engine and t.cuda:
        facts["gpus"] = nvidia_smi_gpus()
        if host.startswith("unix://") and client is not None:
            facts["hooks"] = hooks()
            facts["cdi_specs"] = cdi_specs(facts["info"].get("CDISpecDirs") or [])
    if t.data_source() is not None:
        path = data_path(str(t.data_source()))
        facts.update(data_dir=str(path), data_problem=dir_problem(path))
    if t.network.publish_rpc_port:
        facts["port_in_use"] = port_in_use(t.ps.rpc_port)
    found = Facts(**facts)
    if target is None:
        return found
    more = dict(target(t, client, found, probe))
    own = more.pop("target", {})
    return replace(found, **more, target={**found.target, **own})


def _engine_facts(t: Topology, client: Any, host: str, facts: dict[str, Any]) -> Any:
    import docker

    from orchestrator import images

    if client is None:
        try:
            client = docker.from_env(timeout=30)
            client.ping()
        except docker.errors.DockerException as e:
            client, facts["daemon_error"] = None, daemon_reason(e)
    if client is not None:
        info = client.info()
        facts.update(
            info=info,
            api_version=client.version().get("ApiVersion", ""),
            image_present=images.image_exists(client, t.image_tag),
            base_present=images.image_exists(client, t.image.base),
            disk_free=_disk_free(info.get("DockerRootDir"), host),
        )
    return client


def data_path(data_dir: str) -> Path:
    """Where the data directory is on this host (relative: to the repository, as `make up` mounts it)."""
    return Path(data_dir).expanduser() if Path(data_dir).expanduser().is_absolute() else ROOT / data_dir


def dir_problem(path: Path) -> Optional[str]:
    """Why `path` is not a readable, non-empty directory (None: it is)."""
    if not path.exists():
        return "is not a directory on this host: it does not exist"
    if not path.is_dir():
        return "is not a directory on this host: it is a file"
    if not os.access(path, os.R_OK | os.X_OK):
        return "is not readable by this user"
    if not any(path.iterdir()):
        return "is empty"
    return None


def port_in_use(port: int) -> bool:
    """True when a TCP listener could not bind `port` on every address of this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            return e.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


def port_free(host: str, port: int) -> bool:
    """True when a TCP listener can bind `host`:`port` on this host now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listening_process(port: int) -> Optional[str]:
    """`pid N (command)` of a process of this user listening on TCP `port`; None when none is
    found (the listener is another user's, or not in this PID namespace)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    for proc in Path("/proc").iterdir() if inodes else []:
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return f"pid {proc.name} ({(proc / 'comm').read_text().strip()})"
        except OSError:
            continue
    return None


def _disk_free(root: Optional[str], host: str) -> Optional[int]:
    if not root or not host.startswith("unix://") or not os.path.isdir(root):
        return None
    return shutil.disk_usage(root).free


def hooks() -> list[str]:
    """The NVIDIA hooks on this host's usual binary dirs (dockerd's PATH is not ours)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *HOOK_DIRS])
    return [h for h in NVIDIA_HOOKS if shutil.which(h, path=path)]


def cdi_specs(dirs: list[str]) -> list[str]:
    """Spec files in the engine's CDI dirs that define nvidia.com/gpu devices."""
    found = []
    for d in dirs:
        for p in sorted(Path(d).glob("*")) if Path(d).is_dir() else []:
            try:
                if p.suffix in (".yaml", ".json") and CDI_GPU_KIND in p.read_text(encoding="utf-8", errors="replace"):
                    found.append(str(p))
            except OSError:
                continue
    return found


def nvidia_smi_gpus() -> Optional[list[int]]:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        r = subprocess.run([binary, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [int(i) for i in _GPU_LINE.findall(r.stdout)] if r.returncode == 0 else None


def tool(name: str, *args: str, expect: str = "") -> Optional[str]:
    """The path of command `name` when `name ARGS` runs and prints `expect`; None otherwise."""
    binary = shutil.which(name)
    if binary is None:
        return None
    try:
        r = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return binary if r.returncode == 0 and expect in r.stdout else None
