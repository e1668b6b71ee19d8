"""The typed topology: one pydantic model per section of configs/*.yaml.

`load(path)` reads, parses and validates a file; `Topology.with_workers(n)`
and `Topology.with_strategy(name)` apply the `--workers` and `--strategy`
overrides (`load_with` does all three). Every problem raises one `TopologyError`
whose message is a single line: the file, the YAML path of the field, the
value found and what is allowed, e.g.

    configs/x.yaml: workers.gpus: got [0, 0]; GPU ids must be distinct (one GPU per worker)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, Union, cast

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
)

from app.contract import DATASETS, ENTRY_POINT, FILE_DATASETS, STRATEGIES
from app.options import BY_NAME, OPTIONS, Option, broken_rule, in_topology
from orchestrator.errors import UsageError

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,49}")  # fullmatch: one line, no trailing newline
NAME_RULE = "must be lowercase letters, digits, '-' or '_', starting with a letter or digit, at most 50 characters"
_IMAGE_REF = re.compile(r"^[a-z0-9]+(?:[._/:-][a-z0-9]+)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$")
_MODEL = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_GROUP = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_IFNAME = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([bkmg]?)b?$")
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_FLOAT = re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$")


class TopologyError(UsageError):
    """A bad topology: `path` is the YAML path of the field at fault."""

    def __init__(self, source: str, path: str, problem: str) -> None:
        self.source, self.path, self.problem = source, path, problem
        super().__init__(f"{source}: {path}: {problem}" if path else f"{source}: {problem}")


def _yaml_float(value: Any) -> Any:
    # PyYAML (YAML 1.1) reads `1e-3` as a string; accept it as the number it means.
    if isinstance(value, str) and _FLOAT.match(value.strip()):
        return float(value)
    return value


def _size(value: Any) -> Any:
    """A size as compose takes it: bytes (int) or '512m', '2g', '1gb'."""
    if isinstance(value, bool):
        raise ValueError("must be a size like 512m or 2g, or a number of bytes")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("must be a positive size like 512m or 2g, or a number of bytes")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value.strip().lower())
        if m and float(m.group(1)) > 0:
            return value.strip().lower()
    raise ValueError("must be a positive size like 512m or 2g, or a number of bytes")


def size_bytes(size: int | str) -> int:
    """A size as the topology takes it (bytes, '256m', '2g', '1gb') in bytes."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(size.strip().lower())
    if m is None:
        raise ValueError(f"not a size: {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _group(value: Any) -> Any:
    """A group for group_add: a numeric gid or a group name."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _GROUP.match(value):
        return value
    raise ValueError("must be a group id (a number >= 0, e.g. 44) or a group name like video")


def _loader_workers(value: Any) -> Any:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError("must be auto or a whole number >= 0")


def _image_cache(value: Any) -> Any:
    # The field was a boolean (and YAML reads a bare off/on as one): true is memory.
    if isinstance(value, bool):
        return "memory" if value else "off"
    return value


Float = Annotated[float, BeforeValidator(_yaml_float)]
LoaderWorkers = Annotated[Union[Literal["auto"], int], BeforeValidator(_loader_workers)]
GroupId = Annotated[Union[int, str], BeforeValidator(lambda v: _group(v))]
Size = Annotated[Union[int, str], BeforeValidator(_size)]


class _Section(BaseModel):
    # strict: `batch_size: "256"` or `count: true` is a wrong type, not coerced.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


class Image(_Section):
    """The one image the PS and every worker run (images/Dockerfile)."""

    base: str = Field(min_length=1, pattern=r"^\S+$")
    """Base image the Dockerfile builds on (build arg BASE_IMAGE), e.g.
    pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime."""
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

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _IMAGE_REF.match(v):
            raise ValueError("must be an image reference like ps-compose-x:latest (lowercase name, optional :tag)")
        return v


def _option_type(o: Option) -> Any:
    """The topology's type of a declared option (app/options.py)."""
    kind = o.topology_kind or o.kind
    if o.choices:
        allowed = cast(Any, Literal)[o.choices]  # the option's choices, known at run time
        if o.bool_aliases[0]:  # the field was a boolean (YAML reads a bare on/off as one)
            return Annotated[
                allowed, BeforeValidator(lambda v, a=o.bool_aliases: a[int(v)] if isinstance(v, bool) else v)
            ]
        return allowed
    return {"int": int, "float": Float, "bool": bool, "str": str, "auto_int": LoaderWorkers}[kind]


def _option_field(o: Option) -> Any:
    """A declared option as a topology field: its default (none when the file must give
    it), its bounds and its help as the field's description."""
    bounds: dict[str, Any] = {}
    if o.low is not None:
        bounds["gt" if o.low_open else "ge"] = o.low
    if o.high is not None:
        bounds["lt" if o.high_open else "le"] = o.high
    if o.required:
        return Field(description=o.help, **bounds)
    default = int(o.default) if o.topology_kind == "int" else o.default
    return Field(default=default, description=o.help, **bounds)


def _with_options(
    name: str, base: type[BaseModel], doc: str, after: Optional[dict[str, dict[str, Any]]] = None
) -> type[BaseModel]:
    """`base` (validators, its own fields first) with one field per option of app/options.py
    that the section `name` sets; `after`: the section's other fields, placed after an option."""
    fields: dict[str, Any] = {}
    for o in in_topology(name):
        fields[o.key] = (_option_type(o), _option_field(o))
        fields.update((after or {}).get(o.key, {}))
    return create_model(base.__name__.lstrip("_"), __base__=base, __doc__=doc, __module__=__name__, **fields)


class _Train(_Section):
    """The checks of the train section's values (its fields: `Train`)."""

    @field_validator("model", check_fields=False)
    @classmethod
    def _model(cls, v: str) -> str:
        if not (_MODEL.match(v) or ENTRY_POINT.match(v)):
            raise ValueError("must be a model name like cnn or resnet18, or an entry point package.module:factory")
        return v

    @field_validator("dataset", check_fields=False)
    @classmethod
    def _dataset(cls, v: str) -> str:
        if v not in DATASETS and not ENTRY_POINT.match(v):
            raise ValueError(f"must be one of {', '.join(DATASETS)}, or an entry point package.module:factory")
        return v


# The host paths a topology gives beside the app's options (the render mounts them).
_TRAIN_PATHS = {
    "data_dir": (
        Optional[str],
        Field(
            default=None,
            min_length=1,
            description=(
                "Host directory of the data (relative: to the directory of compose.yaml / where you run). Mounted "
                "read-only at /data. For imagefolder: class folders (10% held out), or train/ and val/ of class "
                "folders "
                "(Imagenette's layout: the PS evaluates on val/)."
            ),
        ),
    ),
    "init_weights": (
        Optional[str],
        Field(
            default=None,
            min_length=1,
            description=(
                "A state dict file (or a final.pt of an earlier run) the model starts from (relative: like data_dir). "
                "Mounted read-only."
            ),
        ),
    ),
}
# The fields of a section that are no option of the app, after the option they follow.
SECTION_EXTRAS: dict[str, dict[str, dict[str, Any]]] = {"train": {"dataset": _TRAIN_PATHS}}
if TYPE_CHECKING:  # the same classes, declared field by field (written from app/options.py)
    from orchestrator.topology.sections import PS, Train
else:
    Train = _with_options(
        "train", _Train, "The training job: model, data, optimizer and strategy.", after=SECTION_EXTRAS["train"]
    )


class _PS(_Section):
    """The parameter server (rank 0). Under strategy allreduce there is none: worker1 hosts the rendezvous on rpc_port
    and checkpoints every checkpoint_every steps."""

    shm_size: Size = "1g"
    """/dev/shm of the PS container."""
    gpu: Optional[int] = Field(default=None, ge=0)
    """GPU id for the PS (cuda only); default none: the PS runs on CPU."""
    rpc_port: int = Field(default=29500, ge=1024, le=65535)
    """The PS's rendezvous port (inside the network; published only if network.publish_rpc_port)."""


if not TYPE_CHECKING:
    PS = _with_options("ps", _PS, _PS.__doc__ or "")


class Workers(_Section):
    """The training workers, ranks 1..count; on cuda each has one GPU, seen as cuda:0."""

    count: int = Field(gt=0)
    """Number of workers (ranks 1..count); `--workers N` overrides it."""
    max: Optional[int] = Field(default=None, gt=0)
    """The most workers `make scale WORKERS=N` may run while the job trains (ranks count+1..max are rendered, started
    only by scale; each has its GPU id reserved); default count. Not for strategy allreduce."""
    gpus: Optional[list[Annotated[int, Field(ge=0)]]] = None
    """One GPU id per worker, in rank order (cuda only); default 0..max-1."""
    shm_size: Size = "2g"
    """/dev/shm of each worker container."""


class Network(_Section):
    """The cluster's private network (a bridge with compose, an overlay on Swarm)."""

    publish_rpc_port: bool = False
    """Publish the PS's rpc_port on the host. PyTorch RPC has no authentication: keep false unless the host is
    firewalled."""
    same_host_copy: bool = True
    """compose (one host): pushes and replies cross through the PS's shared memory (the PS, its shards and the workers
    share one IPC namespace, so one /dev/shm, sized for the exchange), and what still goes through TensorPipe is
    copied process to process (its `cma` channel, one process_vm_readv) instead of through TCP over the bridge. The
    PS, its shards and the workers share one PID and IPC namespace, held by a `pidns` service, and get SYS_PTRACE,
    which with a non-root user and no-new-privileges only lets Docker's seccomp profile pass process_vm_readv
    (docs/design.md). false: a namespace each, every tensor over TCP. Swarm and Kubernetes always go over TCP."""
    ifname: str = "eth0"
    """Interface TensorPipe, Gloo and NCCL bind inside the containers (TP_SOCKET_IFNAME; GLOO_SOCKET_IFNAME follows it;
    NCCL_SOCKET_IFNAME on cuda)."""

    @field_validator("ifname")
    @classmethod
    def _ifname(cls, v: str) -> str:
        if not _IFNAME.match(v):
            raise ValueError("must be a network interface name like eth0")
        return v


_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_NODE_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}=[A-Za-z0-9._-]{1,253}$")
_RESOURCE_KIND = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")


def _node(v: str) -> str:
    if not (_NODE.match(v) or _NODE_LABEL.match(v)):
        raise ValueError("must be a node hostname like gpu-a, or a node label as key=value like gpu=true")
    return v


Node = Annotated[str, AfterValidator(_node)]


class Swarm(_Section):
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


_DRIVER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$")
_DRIVER_OPT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHARED_TYPES = ("nfs", "nfs4", "cifs")  # driver_opts `type` of Docker's local driver that mount a share


class State(_Section):
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


_LABEL_KEY = re.compile(r"^(?:[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _node_selector(v: dict[str, str]) -> dict[str, str]:
    for key, value in v.items():
        if not _LABEL_KEY.match(key):
            raise ValueError(f"label key {key!r} must be a Kubernetes label key like kubernetes.io/hostname or gpu")
        if not _LABEL_VALUE.match(value):
            raise ValueError(f"label value {value!r} (of {key}) must be at most 63 letters, digits, '-', '_' or '.'")
    return v


NodeSelector = Annotated[dict[str, str], AfterValidator(_node_selector)]


class Kubernetes(_Section):
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


class Topology(_Section):
    name: str
    """Names the compose project, the image and runs/<name>/; lowercase letters, digits, '-', '_'."""
    image: Image
    train: Train
    ps: PS = Field(default_factory=PS)
    workers: Workers
    network: Network = Field(default_factory=Network)
    swarm: Swarm = Field(default_factory=Swarm)
    state: State = Field(default_factory=State)
    kubernetes: Kubernetes = Field(default_factory=Kubernetes)
    code: Optional[str] = Field(default=None, min_length=1)
    """Host directory of your own Python code (train.model/dataset as package.module:factory); relative: like
    train.data_dir. Mounted read-only at /code, on PYTHONPATH."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not valid_name(v):
            raise ValueError(NAME_RULE)
        return v

    @property
    def world_size(self) -> int:
        return self.workers.count + 1

    @property
    def image_tag(self) -> str:
        return self.image.tag or f"ps-compose-{self.name}:latest"

    @property
    def cuda(self) -> bool:
        return self.image.device == "cuda"

    @property
    def reads_files(self) -> bool:
        """True when the dataset is read from train.data_dir (your own dataset: when one is given)."""
        return self.train.dataset in FILE_DATASETS or (
            is_entry_point(self.train.dataset) and self.train.data_dir is not None
        )

    def entry_points(self) -> list[tuple[str, str]]:
        """(YAML path, value) of train.model and train.dataset when they name the user's code."""
        fields = (("train.model", self.train.model), ("train.dataset", self.train.dataset))
        return [(path, v) for path, v in fields if is_entry_point(v)]

    @property
    def max_workers(self) -> int:
        """The most workers the job may be scaled to while it runs (workers.max, default count)."""
        return self.workers.max if self.workers.max is not None else self.workers.count

    def worker_gpus(self) -> list[int]:
        """The GPU id of each possible worker (ranks 1..max_workers), in rank order; empty on CPU."""
        if not self.cuda:
            return []
        gpus = self.workers.gpus if self.workers.gpus is not None else list(range(self.max_workers))
        return gpus[: self.max_workers]

    def data_dir(self) -> str:
        """train.data_dir, which `check` requires of a dataset that reads files (ask only then)."""
        if self.train.data_dir is None:
            raise TopologyError("<topology>", "train.data_dir", f"missing for dataset {self.train.dataset!r}")
        return self.train.data_dir

    def ps_gpu(self) -> Optional[int]:
        return self.ps.gpu if self.cuda else None

    def worker_nodes(self) -> list[Optional[str]]:
        """Swarm placement of each worker, in rank order (None: any node)."""
        w = self.swarm.workers
        if w is None or len(w) == 1:
            return [w[0] if w else None] * self.workers.count
        return list(w[: self.workers.count])

    def spans_nodes(self) -> bool:
        """The topology itself places services on more than one node (distinct swarm.ps /
        swarm.workers entries); False when it cannot tell (no placement, or one entry)."""
        named = {n for n in [self.swarm.ps, *(self.swarm.workers or [])] if n is not None}
        return len(named) > 1

    def with_workers(self, count: int, source: str = "--workers") -> Topology:
        """The same topology with `count` workers (GPUs 0..count-1 unless listed)."""
        if count < 1:
            raise TopologyError(source, "workers.count", f"got {count}; must be at least 1")
        t = self.model_copy(update={"workers": self.workers.model_copy(update={"count": count})})
        check(t, source)
        return t

    def with_name(self, name: str, source: str = "--name") -> Topology:
        """The same job under another `name` (`--name`, `make ... NAME=`): its compose project or
        stack, its state volume and runs/<name>/; the image stays the topology's own."""
        if not valid_name(name):
            raise TopologyError(source, "name", f"got {name!r}; {NAME_RULE}")
        image = self.image.model_copy(update={"tag": self.image_tag})
        return self.model_copy(update={"name": name, "image": image})

    def with_strategy(self, name: str, source: str = "--strategy") -> Topology:
        """The same topology trained with strategy `name` (`--strategy`), validated again."""
        if name not in STRATEGIES:
            raise TopologyError(source, "train.strategy", f"got {name!r}; must be one of {', '.join(STRATEGIES)}")
        t = self.model_copy(update={"train": self.train.model_copy(update={"strategy": name})})
        check(t, source)
        return t


def valid_name(name: str) -> bool:
    """What the topology's `name` (and `--name`) allows: NAME_RULE, on one line."""
    return _NAME.fullmatch(name) is not None


def is_entry_point(value: str) -> bool:
    """`package.module:factory` (the user's code) rather than a built-in name."""
    return ":" in value


def check(t: Topology, source: str) -> None:
    """The checks that span fields (pydantic has checked each field); the first problem raises."""
    for part in (_check_inputs, _check_rules, _check_gpus, _check_state, _check_placement):
        part(t, source)


def _check_inputs(t: Topology, source: str) -> None:
    """What the job reads: the user's code for an entry point, a data_dir for a file dataset."""
    for path, value in t.entry_points():
        if t.code is None:
            raise TopologyError(
                source,
                path,
                f"got {value!r}; an entry point needs the top-level `code` (the directory of your Python code)",
            )
    if t.reads_files and t.train.data_dir is None:
        raise TopologyError(
            source,
            "train.data_dir",
            f"missing; required for dataset {t.train.dataset!r} (the host directory of the data)",
        )


def _check_gpus(t: Topology, source: str) -> None:
    gpus = t.workers.gpus
    if gpus is not None and len(set(gpus)) != len(gpus):
        raise TopologyError(source, "workers.gpus", f"got {gpus}; GPU ids must be distinct (one GPU per worker)")
    if t.cuda and gpus is not None and len(gpus) < t.max_workers:
        raise TopologyError(
            source,
            "workers.gpus",
            f"got {gpus} for {t.max_workers} workers; must list one GPU id per worker "
            f"(or leave it out for 0..{t.max_workers - 1})",
        )
    if t.image.group_add and not t.cuda:
        raise TopologyError(
            source,
            "image.group_add",
            f"got {list(t.image.group_add)}; allowed only with image.device cuda (it is for the GPU device nodes)",
        )


def _check_state(t: Topology, source: str) -> None:
    opts = t.state.driver_opts
    if opts and t.state.volume_driver is None:
        raise TopologyError(
            source,
            "state.driver_opts",
            f"got {_show(dict(opts))}; allowed only with state.volume_driver (e.g. local, with type: nfs)",
        )
    if opts.get("type") in SHARED_TYPES and not (opts.get("device") and "addr=" in opts.get("o", "")):
        raise TopologyError(
            source,
            "state.driver_opts",
            f"got {_show(dict(opts))}; type {opts['type']} needs "
            "device (the export, e.g. ':/exports/psc') and o with addr=SERVER (e.g. 'addr=10.0.0.5,rw')",
        )


def _check_placement(t: Topology, source: str) -> None:
    """Swarm's nodes for the workers; a Kubernetes pod's memory above its /dev/shm."""
    nodes = t.swarm.workers
    if nodes is not None and 1 < len(nodes) < t.workers.count:
        raise TopologyError(
            source,
            "swarm.workers",
            f"got {nodes} for {t.workers.count} workers; must list one node per worker, or a single node for all",
        )
    for key, memory, shm_key, shm in (
        ("ps_memory", t.kubernetes.ps_memory, "ps.shm_size", t.ps.shm_size),
        ("worker_memory", t.kubernetes.worker_memory, "workers.shm_size", t.workers.shm_size),
    ):
        if memory is not None and size_bytes(memory) <= size_bytes(shm):
            raise TopologyError(
                source,
                f"kubernetes.{key}",
                f"got {_show(memory)}; must be more than {shm_key} ({shm}): the pod's /dev/shm is memory it is "
                "charged for",
            )


# The topology's own place for the options of the rules that no topology key sets.
_RULE_PATHS = {"max_workers": "workers.max", "device": "image.device", "world_size": "workers.count"}


def rule_values(t: Topology) -> dict[str, Any]:
    """The job's values as the rules between options (app/options.py RULES) read them."""
    values: dict[str, Any] = {o.name: getattr(getattr(t, o.section), o.key) for o in OPTIONS if o.topology}
    values.update(
        max_workers=t.workers.max,
        world_size=t.workers.count + 1,
        device=t.image.device,
        role=None,
        given=frozenset(o.name for o in OPTIONS if o.topology) | ({"max_workers"} if t.workers.max else set()),
    )
    return values


def _check_rules(t: Topology, source: str) -> None:
    """The rules between options that the app's parser evaluates too, named by their YAML path."""
    values = rule_values(t)
    rule = broken_rule(values)
    if rule is not None:
        o = BY_NAME[rule.option]
        path = o.topology or _RULE_PATHS[o.name]
        raise TopologyError(source, path, f"got {_show(values[o.name])}; {rule.allowed(values)}")


def load(path: str | Path) -> Topology:
    """Read, parse and validate a topology file."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TopologyError(source, "", "no such file") from None
    except IsADirectoryError:
        raise TopologyError(source, "", "is a directory, not a topology file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TopologyError(source, "", f"cannot read: {_one_line(e)}") from None
    return parse(text, source)


def load_with(
    path: str | Path, *, workers: Optional[int] = None, strategy: Optional[str] = None, name: Optional[str] = None
) -> Topology:
    """`load(path)` with the `--workers`, `--strategy` and `--name` overrides applied (None: as in
    the file); an error names the file and the flag."""
    t = load(path)
    if name is not None:
        t = t.with_name(name, source=f"{path} with --name")
    if workers is not None:
        t = t.with_workers(workers, source=f"{path} with --workers {workers}")
    if strategy is not None:
        t = t.with_strategy(strategy, source=f"{path} with --strategy {strategy}")
    return t


def parse(text: str, source: str = "<topology>") -> Topology:
    """Validate a topology given as YAML text (`source` names it in errors)."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = getattr(e, "problem", None) or _one_line(e)
        raise TopologyError(source, "", f"not valid YAML: {where}{what}") from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {_yaml_type(data)}"
        raise TopologyError(source, "", f"got {got}; must be a mapping with keys {_keys(Topology)}")
    try:
        t = Topology.model_validate(data)
    except ValidationError as e:
        raise _error(e, source) from None
    check(t, source)
    return t


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _error(e: ValidationError, source: str) -> TopologyError:
    """The first pydantic error as one line with its YAML path."""
    err = e.errors()[0]
    loc = err["loc"]
    path = _dotted(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        return TopologyError(source, path, f"unknown key; allowed: {_keys(_model_at(loc[:-1]))}")
    if kind == "missing":
        return TopologyError(source, path, "missing; this key is required")
    if kind in ("model_type", "dict_type"):
        return TopologyError(
            source, path, f"got {_show(err['input'])}; must be a mapping with keys {_keys(_model_at(loc))}"
        )
    msg = err["msg"]
    msg = re.sub(r"^Value error, ", "", msg)
    msg = re.sub(r"^(Input|String|List) should (be|have|match)", lambda m: f"must {m.group(2)}", msg)
    return TopologyError(source, path, f"got {_show(err['input'])}; {msg}")


def _model_at(loc: tuple) -> type[BaseModel]:
    model: type[BaseModel] = Topology
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            break
        model = field.annotation
    return model


def _keys(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _yaml_type(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
