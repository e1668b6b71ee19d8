"""Topology -> compose document.

`render(topology)` is pure: it builds the whole compose file as plain data
and touches nothing. `dump(doc)` turns it into YAML text that depends only on
the document (`orchestrator.render.yamlio` writes it).

The names the container adapter relies on are the constants below and
`project_name`; the service names are in `orchestrator.topology.services`.

Strategy `allreduce` (a DDP job, app/ddp.py) has no PS: services worker1..N
only, rank 0 (worker1) hosts the rendezvous, builds the image and writes the
checkpoints.
"""

from __future__ import annotations

from typing import Any, Optional

from orchestrator.paths import DOCKERFILE
from orchestrator.render.yamlio import yaml_text
from orchestrator import runs
from orchestrator.topology.services import (
    LABEL_PROJECT, LABEL_RANK, LABEL_ROLE, PS_SERVICE, has_ps, rendezvous_service, shard_service, worker_service,
)
from orchestrator.topology.model import Topology

NETWORK = "cluster"
STATE_VOLUME = "state"  # named volume; compose calls it <project>_state
APP_USER = "1000:1000"  # psc, created by images/Dockerfile

# Paths inside the containers (docs/design.md).
DATA_DIR = "/data"
STATE_DIR = "/state"
CHECKPOINT_DIR = "/state/checkpoints"
METRICS_DIR = "/state/metrics"
CACHE_DIR = "/state/cache"  # train.image_cache: file
CODE_DIR = "/code"  # the user's Python code (`code`), read-only, on PYTHONPATH
INIT_WEIGHTS = "/init/weights.pt"  # train.init_weights, read-only
APP_DIR = "/opt/ps-compose"  # the app in the image (images/Dockerfile's PYTHONPATH)

HEALTHCHECK = {
    "test": ["CMD", "python", "-m", "app", "health"],
    "interval": "3s",
    "timeout": "5s",
    "retries": 20,
    "start_period": "10s",
}


def project_name(t: Topology) -> str:
    """The compose project name (`-p`); the file has no top-level `name:`."""
    return t.name


def app_environment(
    t: Topology,
    rank: int,
    *,
    master_addr: str,
    master_port: int,
    data_dir: Optional[str],
    checkpoint_dir: str,
    metrics_dir: str,
    ifname: str,
    init_weights: Optional[str] = None,
    cache_dir: Optional[str] = None,
) -> dict[str, str]:
    """The environment `python -m app` reads for `rank` (0: the PS).

    The one mapping from topology to the app's PSC_* variables; the render
    and `orchestrator local` both call it, with container or host paths.
    `data_dir` is left out when the dataset reads no files, `init_weights` when
    the topology has none, `cache_dir` (the image cache's files) unless imagefolder.
    """
    tr = t.train
    if rank == 0:
        device = "cuda" if t.ps_gpu() is not None else "cpu"
    else:
        device = t.image.device
    env = {
        "PSC_RANK": str(rank),
        "PSC_WORLD_SIZE": str(t.world_size),
        "PSC_MASTER_ADDR": master_addr,
        "PSC_MASTER_PORT": str(master_port),
        "PSC_DEVICE": device,
        "PSC_MODEL": tr.model,
        "PSC_DATASET": tr.dataset,
    }
    if t.reads_files and data_dir is not None:
        env["PSC_DATA_DIR"] = data_dir
    env.update({
        "PSC_BATCH_SIZE": str(tr.batch_size),
        "PSC_LR": repr(tr.lr),
        "PSC_MOMENTUM": repr(tr.momentum),
        "PSC_NUM_EPOCHS": str(tr.epochs),
        "PSC_MAX_STEPS": str(tr.max_steps),
        "PSC_STRATEGY": tr.strategy,
        "PSC_STALENESS": str(tr.staleness),
        "PSC_STALENESS_LR": str(tr.staleness_lr).lower(),
        "PSC_OVERLAP": str(tr.overlap).lower(),
        "PSC_COMPRESS": tr.compress,
        "PSC_SEED": str(tr.seed),
        "PSC_EVAL_EVERY": str(tr.eval_every),
        "PSC_LOG_EVERY": str(tr.log_every),
        "PSC_LOADER_WORKERS": str(tr.loader_workers),
        "PSC_RPC_TIMEOUT": str(t.ps.rpc_timeout),
        "PSC_JOIN_TIMEOUT": str(t.ps.join_timeout),
        "PSC_CHECKPOINT_EVERY": str(t.ps.checkpoint_every),
        "PSC_CHECKPOINT_DIR": checkpoint_dir,
        "PSC_METRICS_DIR": metrics_dir,
        "TP_SOCKET_IFNAME": ifname,
    })
    if t.cuda:  # NCCL (allreduce on GPUs) binds the same interface as TensorPipe and Gloo
        env["NCCL_SOCKET_IFNAME"] = ifname
    if t.ps.shards > 1:  # every process must know; absent for an unsharded PS
        env["PSC_SHARDS"] = str(t.ps.shards)
    if tr.dataset == "imagefolder" and tr.image_size != 224:  # the app's default
        env["PSC_IMAGE_SIZE"] = str(tr.image_size)
    if tr.loader_workers == "auto":  # what auto divides the host's CPUs by: the workers on one host
        env["PSC_HOST_WORKERS"] = str(t.workers.count)
    if tr.image_cache != "auto":  # absent for auto (the app's default)
        env["PSC_IMAGE_CACHE"] = tr.image_cache
    if tr.dataset == "imagefolder" and cache_dir is not None:
        env["PSC_CACHE_DIR"] = cache_dir
    if t.train.init_weights is not None and init_weights is not None:
        env["PSC_INIT_WEIGHTS"] = init_weights
    if tr.precision != "fp32":  # absent for fp32 (the app's default)
        env["PSC_PRECISION"] = tr.precision
    if tr.channels_last:
        env["PSC_CHANNELS_LAST"] = "true"
    return env


def render(t: Topology) -> dict[str, Any]:
    """The whole compose document for `t` (pure: no I/O)."""
    services = {PS_SERVICE: _ps(t)} if has_ps(t) else {}
    for index in range(1, t.ps.shards if has_ps(t) else 1):
        services[shard_service(index)] = _shard(t, index)
    for rank in range(1, t.workers.count + 1):
        services[worker_service(rank)] = _worker(t, rank)
    return {
        "services": services,
        "networks": {NETWORK: {"driver": "bridge", "labels": {LABEL_PROJECT: t.name}}},
        "volumes": {STATE_VOLUME: state_volume(t)},
    }


def state_volume(t: Topology) -> dict[str, Any]:
    """The named volume `state`: Docker's local driver by default, or `state.volume_driver`
    with its `driver_opts` (a shared volume, e.g. NFS: docs/multi-host.md)."""
    volume: dict[str, Any] = {}
    if t.state.volume_driver is not None:
        volume["driver"] = t.state.volume_driver
        if t.state.driver_opts:
            volume["driver_opts"] = dict(t.state.driver_opts)
    volume["labels"] = {LABEL_PROJECT: t.name}
    return volume


def _ps(t: Topology) -> dict[str, Any]:
    svc = _builds(t, _common(t, 0, "ps", t.ps.shm_size, t.ps_gpu()))
    svc["healthcheck"] = dict(HEALTHCHECK)
    # Time to write a checkpoint on SIGTERM before compose sends SIGKILL.
    svc["stop_grace_period"] = "30s"
    # A crashed PS comes back and resumes from its newest good checkpoint.
    svc["restart"] = "on-failure"
    if t.network.publish_rpc_port:
        svc["ports"] = [f"{t.ps.rpc_port}:{t.ps.rpc_port}"]
    return svc


def _shard(t: Topology, index: int) -> dict[str, Any]:
    """PS shard `index`: the PS's image and environment, its own slice of the model."""
    svc = _common(t, 0, "ps", t.ps.shm_size, t.ps_gpu())
    svc["environment"]["PSC_SHARD"] = str(index)
    svc["depends_on"] = {PS_SERVICE: {"condition": "service_healthy"}}
    svc["stop_grace_period"] = "30s"  # it checkpoints its slice on SIGTERM
    svc["restart"] = "on-failure"
    return svc


def _builds(t: Topology, svc: dict[str, Any]) -> dict[str, Any]:
    """`svc` with the image's `build`. Only rank 0 builds: the others use the image it
    tags (`docker compose build` builds once; compose does not try to pull an image
    another service builds)."""
    return {
        "image": svc.pop("image"),
        "build": {"context": ".", "dockerfile": DOCKERFILE, "args": {"BASE_IMAGE": t.image.base, "PIP_SOURCE": t.image.pip_source}},
        **svc,
    }


def _worker(t: Topology, rank: int) -> dict[str, Any]:
    svc = _common(t, rank, "worker", t.workers.shm_size, t.worker_gpus()[rank - 1] if t.cuda else None)
    if has_ps(t):
        svc["depends_on"] = {PS_SERVICE: {"condition": "service_healthy"}}
    elif rank == 1:
        # Rank 0 of the DDP job: it hosts the rendezvous and writes the checkpoints.
        svc = _builds(t, svc)
        if t.network.publish_rpc_port:
            svc["ports"] = [f"{t.ps.rpc_port}:{t.ps.rpc_port}"]
    else:
        # No healthcheck to wait for: the rendezvous waits (up to rpc_timeout) for all.
        svc["depends_on"] = {worker_service(1): {"condition": "service_started"}}
    # A lost peer fails every rank's step: each exits 1, comes back, and the job
    # resumes from rank 0's newest checkpoint.
    svc["restart"] = "on-failure"
    return svc


def _common(t: Topology, rank: int, role: str, shm_size: int | str, gpu: Optional[int]) -> dict[str, Any]:
    env = app_environment(
        t, rank,
        master_addr=rendezvous_service(t), master_port=t.ps.rpc_port,
        data_dir=DATA_DIR, checkpoint_dir=CHECKPOINT_DIR, metrics_dir=METRICS_DIR,
        ifname=t.network.ifname, init_weights=INIT_WEIGHTS, cache_dir=CACHE_DIR,
    )
    volumes: list[dict[str, Any]] = []
    if t.reads_files:
        volumes.append({"type": "bind", "source": _bind_source(t.train.data_dir), "target": DATA_DIR, "read_only": True})
    if t.code is not None:
        # Mounted, not copied into the image: edit and run again without a rebuild.
        volumes.append({"type": "bind", "source": _bind_source(t.code), "target": CODE_DIR, "read_only": True})
        env["PYTHONPATH"] = f"{APP_DIR}:{CODE_DIR}"
    if t.train.init_weights is not None:
        volumes.append({"type": "bind", "source": _bind_source(t.train.init_weights), "target": INIT_WEIGHTS,
                        "read_only": True})
    volumes.append({"type": "volume", "source": STATE_VOLUME, "target": STATE_DIR})
    # The run's id and --resume, from the environment of the compose / stack call (orchestrator.runs):
    # the file stays the same from run to run.
    env.update(runs.interpolated())
    svc: dict[str, Any] = {
        "image": t.image_tag,
        "command": [role],
        "environment": env,
        "labels": {LABEL_PROJECT: t.name, LABEL_ROLE: role, LABEL_RANK: str(rank)},
        "user": APP_USER,
        "init": True,  # tini as PID 1: SIGTERM reaches Python, zombies are reaped
        "shm_size": shm_size,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "networks": [NETWORK],
        "volumes": volumes,
    }
    if gpu is not None:
        if t.image.group_add:  # device nodes restricted to a group on the host
            svc["group_add"] = list(t.image.group_add)
        svc["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "device_ids": [str(gpu)], "capabilities": ["gpu"]},
        ]}}}
    elif t.cuda:
        # The CUDA base image says NVIDIA_VISIBLE_DEVICES=all: on a host whose default
        # runtime is nvidia, a service without a GPU would otherwise see every GPU.
        env["NVIDIA_VISIBLE_DEVICES"] = "void"
    return svc


def _bind_source(path: str) -> str:
    """A relative host path as compose reads it: relative to the compose file's directory."""
    if path.startswith(("/", "./", "../", "~")) or path in (".", ".."):
        return path
    return "./" + path


def security_warnings(t: Topology) -> list[str]:
    """One line per risky setting the topology asks for (printed by the CLI)."""
    out = []
    if t.network.publish_rpc_port:
        out.append(
            f"network.publish_rpc_port: {'the PS' if has_ps(t) else worker_service(1)}'s port {t.ps.rpc_port} "
            "is published on every host address; "
            + ("PyTorch RPC has no authentication (whoever reaches it can run code)" if has_ps(t)
               else "the DDP rendezvous (a c10d TCPStore) has no authentication")
            + ": firewall it"
        )
    return out


def dump(doc: dict[str, Any], name: str) -> str:
    """The compose file as text; the same document gives the same bytes."""
    header = (
        f"# Rendered from the topology {name!r} by `python -m orchestrator render`.\n"
        "# Do not edit: change configs/*.yaml and render again.\n"
    )
    return header + yaml_text(doc)
