"""The topology's sections whose fields are written here: image, workers, network, swarm,
state, kubernetes, tracking. (train and ps get their fields from app/options.py: option_sections.py
builds them.) Each field's docstring is its text in docs/topology.md."""

from __future__ import annotations

import re
from typing import Annotated, Literal, Optional

from pydantic import Field, ValidationInfo, field_validator

from orchestrator.topology.values import GroupId, Node, NodeSelector, Section, Size

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# What the render sets in every process itself: a topology's `env` may not take them over.
RENDER_SETS = frozenset(
    {
        "PYTHONPATH",
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
        "NCCL_HOSTID",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
    }
)


def env_name_problem(name: str) -> str:
    """What is wrong with a name in the topology's `env`; '' when nothing is."""
    if not _ENV_NAME.match(name):
        return "must be a variable's name: letters, digits and '_', not starting with a digit"
    if name.startswith("PSC_"):
        return "PSC_ is the app's own: set the topology's key instead"
    if name in RENDER_SETS:
        return "the render sets it for every process (its value follows the topology)"
    return ""


def requirement_problem(line: str) -> str:
    """What is wrong with one pip requirement (`einops`, `timm==1.0.*`, `pkg[extra]>=2`); '' when nothing
    is. A URL, a path or an option (`-e`, `--index-url`) is not one: the image's wheels come from the index."""
    from packaging.requirements import InvalidRequirement, Requirement

    if line.strip().startswith("-"):
        return "must be a requirement (name, extras, version); options such as -e or --index-url are not taken"
    try:
        req = Requirement(line)
    except InvalidRequirement as e:
        return f"must be a pip requirement like einops or timm==1.0.* ({str(e).splitlines()[0]})"
    if req.url:
        return "must be a requirement from the index (name and version), not a URL"
    return ""


_IMAGE_REF = re.compile(r"^[a-z0-9]+(?:[._/:-][a-z0-9]+)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$")
_IFNAME = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
_RESOURCE_KIND = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")
_DRIVER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$")
_DRIVER_OPT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHARED_TYPES = ("nfs", "nfs4", "cifs")  # driver_opts `type` of Docker's local driver that mount a share
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
MAX_WORKERS = 1024  # a service each in the render, and a rank each in the PS's tables


OFFLINE_BASE = "ps-compose-base:bookworm"  # orchestrator.images builds it on first use


class Image(Section):
    """The one image the PS and every worker run (images/Dockerfile). Without an `image:` section: the offline
    base (built on first use), device cpu, the wheelhouse; `local` runs no image at all."""

    base: str = Field(min_length=1, pattern=r"^\S+$")
    """Base image the Dockerfile builds on (build arg BASE_IMAGE), e.g.
    pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime."""
    device: Literal["cuda", "cpu"]
    """cuda: one GPU per worker, seen as cuda:0 inside; cpu: no GPUs."""
    tag: Optional[str] = None
    """Name of the built image; default ps-compose-<name>:latest."""
    pip_source: Literal["index", "wheelhouse"] = "index"
    """Where the build installs the app's packages (build arg PIP_SOURCE): index (PyPI) or wheelhouse
    (images/wheelhouse/, offline)."""
    group_add: list[GroupId] = Field(default_factory=list)
    """cuda only: groups added to every container with a GPU, for hosts that restrict /dev/nvidia* to a group
    (NVreg_DeviceFileMode=0660); give the host's numeric gid (stat -c %g /dev/nvidia0): a name is looked up in the
    image, not on the host. `doctor`'s probe checks it."""

    packages: list[str] = Field(default_factory=list)
    """pip requirements (einops, timm==1.0.*) installed in a layer of their own over the app's image, with what they
    need (resolved on this host against the image's own packages, which stay as they are; from PyPI, or as wheels
    fetched here for the offline path); `local` checks that its Python has them. Recorded with the run."""
    requirements: Optional[str] = None
    """A pip requirements file (requirement lines only), e.g. in `code`; its lines join `packages`. Relative to the
    repository (or absolute)."""

    @field_validator("packages")
    @classmethod
    def _packages(cls, v: list[str]) -> list[str]:
        for line in v:
            problem = requirement_problem(line)
            if problem:
                raise ValueError(f"got {line!r}; {problem}")
        return v

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _IMAGE_REF.match(v):
            raise ValueError("must be an image reference like ps-compose-x:latest (lowercase name, optional :tag)")
        return v


class Workers(Section):
    """The training workers, ranks 1..count; on cuda each has one GPU, seen as cuda:0."""

    count: int = Field(gt=0, le=MAX_WORKERS)
    """Number of workers (ranks 1..count); `--workers N` overrides it."""
    max: Optional[int] = Field(default=None, gt=0, le=MAX_WORKERS)
    """The most workers `make scale WORKERS=N` may run while the job trains (ranks count+1..max are rendered, started
    only by scale; each has its GPU id reserved); default count. Not for strategy allreduce."""
    gpus: Optional[list[Annotated[int, Field(ge=0)]]] = None
    """One GPU id per worker, in rank order (cuda only); default 0..max-1."""
    shm_size: Size = "2g"
    """/dev/shm of each worker container."""


class Network(Section):
    """The cluster's private network (a bridge with compose, an overlay on Swarm)."""

    publish_rpc_port: bool = False
    """Publish the PS's rpc_port on the host (TCP, CURVE). A connection must prove the run's secret before a message
    is read, yet anyone may try and load the PS: keep false unless the host is firewalled."""
    same_host_copy: bool = True
    """compose (one host): pushes and replies cross through the PS's shared memory (the PS, its shards and the workers
    share one IPC namespace, so one /dev/shm, sized for the exchange). The PS, its shards and the workers share one
    PID and IPC namespace, held by a `pidns` service (docs/design.md), with no capability added. false: a namespace
    each, every tensor over the job's UNIX sockets. Swarm and Kubernetes always go over TCP (CURVE)."""
    ifname: str = "eth0"
    """Interface Gloo and NCCL bind inside the containers (GLOO_SOCKET_IFNAME; NCCL_SOCKET_IFNAME on cuda)."""

    @field_validator("ifname")
    @classmethod
    def _ifname(cls, v: str) -> str:
        if not _IFNAME.match(v):
            raise ValueError("must be a network interface name like eth0")
        return v


class Swarm(Section):
    """Read only by `render --target swarm` (docker stack deploy); compose ignores it."""

    ps: Optional[Node] = None
    """The node the PS runs on: a hostname (node.hostname), or a node label key=value (docker node update --label-add).
    Default: any node of a one-node swarm; on several nodes the manager (node.role==manager), since the PS's
    checkpoints are in that node's volume, unless state.volume_driver is a shared one."""
    workers: Optional[list[Node]] = Field(default=None, min_length=1)
    """Where each worker runs: one entry per worker in rank order, or a single entry for all of them. Default: any
    node."""
    gpu_resource: str = "gpu"
    """The generic resource kind GPU nodes advertise (dockerd node-generic-resources: ["gpu=GPU-<uuid>", ...]); each
    GPU worker reserves one."""

    @field_validator("gpu_resource")
    @classmethod
    def _kind(cls, v: str) -> str:
        if not _RESOURCE_KIND.match(v):
            raise ValueError("must be a resource kind like gpu or NVIDIA-GPU")
        return v


class State(Section):
    """The named volume `state` (/state in every container: the PS's checkpoints, final.pt, the metrics)."""

    volume_driver: Optional[str] = None
    """Volume driver of the state volume; default: Docker's local driver, a directory on each host, so on Swarm a PS
    that moves to another node starts from nothing (unless pinned: docs/multi-host.md). A shared volume lets it
    resume anywhere: local with driver_opts type nfs, or a volume plugin."""
    driver_opts: dict[str, str] = Field(default_factory=dict)
    """Options for volume_driver (docker volume create -o), as strings, e.g. for NFS with the local driver: {type: nfs,
    o: "addr=10.0.0.5,rw,nfsvers=4", device: ":/exports/psc"}. Only with volume_driver."""

    @field_validator("volume_driver")
    @classmethod
    def _driver(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _DRIVER.match(v):
            raise ValueError("must be a volume driver name like local or a plugin name like vieux/sshfs")
        return v

    @field_validator("driver_opts")
    @classmethod
    def _opts(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not _DRIVER_OPT.match(k)]
        if bad:
            raise ValueError(f"option name {bad[0]!r} must be letters, digits, '.', '_' or '-' (like type, o, device)")
        return v

    @property
    def shared(self) -> bool:
        """The volume is one share every node mounts (an NFS/CIFS mount of the local driver, or
        a volume plugin), not a directory of each host."""
        if self.volume_driver is None:
            return False
        return self.volume_driver != "local" or self.driver_opts.get("type") in SHARED_TYPES


class Kubernetes(Section):
    """Read only by `render --target kubernetes` (kubectl apply -f); compose and Swarm ignore it."""

    state_size: Size = "10g"
    """Storage the PS's PersistentVolumeClaim asks for (its checkpoints, final.pt and metrics at /state)."""
    storage_class: Optional[str] = None
    """storageClassName of that claim; default: the cluster's default storage class. Strategy allreduce needs one with
    ReadWriteMany (every rank reads rank 0's checkpoints)."""
    data_claim: Optional[str] = None
    """A PersistentVolumeClaim holding the data, mounted read-only at /data; default: train.data_dir as a hostPath,
    which must then exist at that path on every node."""
    ps_node_selector: NodeSelector = Field(default_factory=dict)
    """nodeSelector of the PS (and its shards), e.g. {kubernetes.io/hostname: ps-host}."""
    worker_node_selector: NodeSelector = Field(default_factory=dict)
    """nodeSelector of every worker, e.g. {nvidia.com/gpu.present: "true"}."""
    ps_cpu: float = Field(default=1.0, gt=0)
    """CPU cores the PS pod (and each shard's) requests; no CPU limit, so it may use idle cores."""
    ps_memory: Optional[Size] = None
    """Memory the PS pod requests and is limited to (so it is not evicted first); it holds its /dev/shm, a memory
    emptyDir: default ps.shm_size + 4g."""
    worker_cpu: float = Field(default=1.0, gt=0)
    """CPU cores each worker pod requests; no CPU limit."""
    worker_memory: Optional[Size] = None
    """Memory each worker pod requests and is limited to; it holds its /dev/shm: default workers.shm_size + 4g."""

    @field_validator("storage_class", "data_claim")
    @classmethod
    def _object_name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _CLAIM.match(v):
            raise ValueError("must be a Kubernetes object name: lowercase letters, digits, '-' and '.'")
        return v


class Tracking(Section):
    """Where the PS logs its runs (parameters, curves, the exported model): an MLflow tracking server."""

    mlflow: bool = False
    """true: an MLflow tracking server of the project's own runs beside the cluster (service `mlflow`, compose target
    only): its runs in sqlite on the volume `mlflow`, which `make down` keeps, its UI on http://127.0.0.1:5000 (another
    host port: PSC_MLFLOW_PORT), and the PS logs to it unless MLFLOW_TRACKING_URI names another server. false: the
    PS logs to MLFLOW_TRACKING_URI where the call sets it, else nowhere."""

    auth: bool = False
    """true: the project's own server (tracking.mlflow: true) asks every request for a user and password (MLflow's
    basic auth, `mlflow server --app-name basic-auth`): its admin is MLFLOW_TRACKING_USERNAME (default admin) with
    MLFLOW_TRACKING_PASSWORD, both from the environment of `make up` (which refuses without the password), and the
    PS logs with them. false: any local user of the host reaches the server's runs and models."""

    @field_validator("auth")
    @classmethod
    def _own_server(cls, v: bool, info: ValidationInfo) -> bool:
        if v and not info.data.get("mlflow"):
            raise ValueError("true needs tracking.mlflow: true (it guards the project's own server)")
        return v


def default_image() -> Image:
    """The image of a topology with no `image:` section (see Image)."""
    return Image(base=OFFLINE_BASE, device="cpu", pip_source="wheelhouse")
