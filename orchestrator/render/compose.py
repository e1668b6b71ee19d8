"""Topology -> compose document.

`render(topology)` is pure: it builds the whole compose file as plain data
and touches nothing. `dump(doc)` turns it into YAML text that depends only on
the document (`orchestrator.render.yamlio` writes it).

The names the container adapter relies on are the constants below and
`project_name`; the service names are in `orchestrator.topology.services`.

Workers count+1..`workers.max` (a job that `make scale` may grow while it runs)
are rendered under the compose profile `scale`: `up` starts ranks 1..count,
and `scale` starts the others by name (compose starts a service of a profile
that is named on its command line); every service then has PSC_MAX_WORKERS.

Strategy `allreduce` (a DDP job, app/allreduce/job.py) has no PS: services worker1..N
only; rank 0 (worker1) builds the image and writes the checkpoints. On one host the ranks share
the `pidns` holder's network namespace and meet on its loopback, their rendezvous files on the
`exchange` volume (orchestrator.render.holder); elsewhere (swarm) worker1 hosts a TCPStore.
"""

from __future__ import annotations

from typing import Any, Optional

from app.contract import SHARD_DATASETS, STOP_FILE_ENV, TENSORBOARD_DIR
from app.option_table import BY_NAME, OPTIONS, Option
from app.options import ALWAYS
from orchestrator import runs
from orchestrator.paths import DOCKERFILE
from orchestrator.render import tracking
from orchestrator.render.holder import (
    APP_USER,
    EXCHANGE_VOLUME,
    exchange_volume,
    holder,
    join_namespaces,
    loopback_rendezvous,
    own_network_namespace,
    private_exchange,
    shares_pid_namespace,
)
from orchestrator.render.yamlio import yaml_text
from orchestrator.topology.model import Topology
from orchestrator.topology.services import (
    LABEL_PROJECT,
    LABEL_RANK,
    LABEL_ROLE,
    PIDNS_SERVICE,
    PS_SERVICE,
    has_ps,
    rendezvous_service,
    shard_service,
    worker_name,
)

NETWORK = "cluster"
SCALE_PROFILE = "scale"  # the workers above workers.count: started only by `scale`
STATE_VOLUME = "state"  # named volume; compose calls it <project>_state
# The job's private exchange (a tmpfs volume) and its namespaces' holder on one host:
# orchestrator.render.holder.
# A mistake that fails a process at every start is kept here, in the container's own filesystem:
# its restart says it again and exits 0 instead of failing in a loop (app/stops.py).
STOP_FILE = "/tmp/psc-stopped"

# Paths inside the containers (docs/design.md).
DATA_DIR = "/data"
EVAL_DIR = "/data-eval"  # the folder of train.eval_data's shards, when they are local
STATE_DIR = "/state"
CHECKPOINT_DIR = "/state/checkpoints"
METRICS_DIR = "/state/metrics"
CACHE_DIR = "/state/cache"  # train.image_cache: file
CODE_DIR = "/code"  # the user's Python code (`code`), read-only, on PYTHONPATH
INIT_WEIGHTS = "/init/weights.pt"  # train.init_weights, read-only
APP_DIR = "/opt/ps-compose"  # the app in the image (images/Dockerfile's PYTHONPATH)

# `make tensorboard` (orchestrator/verbs/board.py): TensorBoard on the state
# volume, a service of the project that `up` leaves alone (its profile is never active there).
TENSORBOARD_SERVICE = "tensorboard"
TENSORBOARD_PROFILE = "tensorboard"
TENSORBOARD_ROOT = f"{METRICS_DIR}/{TENSORBOARD_DIR}"  # the app's event files: <run id>/<process>/
TENSORBOARD_CONTAINER_PORT = 6006
# Read from the environment of the `docker compose` call, as the run id is: the run to show
# (empty: every run of the project) and the host port on 127.0.0.1.
TENSORBOARD_RUN = "PSC_TENSORBOARD_RUN"
TENSORBOARD_PORT = "PSC_TENSORBOARD_PORT"
# Services that show a run and are no part of it: what waits for a run's end and `make status` leave them out.
SERVING = (TENSORBOARD_SERVICE, tracking.MLFLOW_SERVICE)

MLFLOW_ENVIRONMENT = {"MLFLOW_TRACKING_URI": "${MLFLOW_TRACKING_URI:-}"}

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
    eval_dir: Optional[str] = None,
) -> dict[str, str]:
    """The environment `python -m app` reads for `rank` (0: the PS).

    The one mapping from topology to the app's PSC_* variables; the render
    and `orchestrator local` both call it, with container or host paths.
    `data_dir` is left out when the dataset reads no files, `init_weights` when
    the topology has none, `cache_dir` (the image cache's files) unless imagefolder.
    `data_dir` and `eval_dir` are where the data's and the held-out shards' folders are
    mounted; a URL reaches the app as given.
    """
    if rank == 0:
        device = "cuda" if t.ps_gpu() is not None else "cpu"
    else:
        device = t.image.device
    tr = t.train
    # The options the render places itself (who this process is, where its files are);
    # every other option of app/options.py comes from the topology key it names.
    placed: dict[str, Any] = {
        "rank": rank,
        "world_size": t.world_size,
        "master_addr": master_addr,
        "master_port": master_port,
        "device": device,
        "checkpoint_dir": checkpoint_dir,
        "metrics_dir": metrics_dir,
    }
    if t.max_workers > t.workers.count:  # the PS admits ranks up to it; each worker shares epochs by the live set
        placed["max_workers"] = t.max_workers
    if t.reads_files and data_dir is not None:
        placed["data_dir"] = t.data_for(data_dir)
    if tr.eval_data and eval_dir is not None:
        placed["eval_data"] = t.eval_for(eval_dir)
    if tr.loader_workers == "auto":  # what auto divides the host's CPUs by: the workers on one host
        placed["host_workers"] = t.workers.count
    if tr.dataset == "imagefolder" and cache_dir is not None:
        placed["cache_dir"] = cache_dir
    if tr.init_weights is not None and init_weights is not None:
        placed["init_weights"] = init_weights
    env: dict[str, str] = {}
    for o in OPTIONS:
        if o.name in placed:
            env[o.env] = o.text(placed[o.name])
        elif o.topology and _passed_on(o, t):
            env[o.env] = o.text(getattr(getattr(t, o.section), o.key))
        if o.name == "metrics_dir":
            env["GLOO_SOCKET_IFNAME"] = ifname
            if t.cuda:  # NCCL (allreduce on GPUs) binds the same interface as Gloo
                env["NCCL_SOCKET_IFNAME"] = ifname
    return env


def _passed_on(o: Option, t: Topology) -> bool:
    """Whether the render writes option `o` for `t`: always, or (CHANGED) only when the
    topology's value is not the app's default, which the app then uses."""
    if o.name == "image_size" and t.train.dataset not in ("imagefolder", *SHARD_DATASETS):
        return False  # only imagefolder and webdataset crop
    if o.name == "lr" and "lr" in t.train.optimizer:
        return False  # the optimizer gives its own rate
    value = getattr(getattr(t, o.section), o.key)
    return o.emit == ALWAYS or value != o.default


def render(t: Topology, *, one_host: bool = True) -> dict[str, Any]:
    """The whole compose document for `t` (pure: no I/O). `one_host=False`: the document
    other targets build on (swarm spreads it over nodes), without the shared PID namespace."""
    services = {PS_SERVICE: _ps(t)} if has_ps(t) else {}
    for index in range(1, t.ps.shards if has_ps(t) else 1):
        services[shard_service(index)] = _shard(t, index)
    for rank in range(1, t.max_workers + 1):
        services[worker_name(rank)] = _worker(t, rank)
        if rank > t.workers.count:
            services[worker_name(rank)]["profiles"] = [SCALE_PROFILE]
    own_network = one_host and own_network_namespace(t)  # allreduce: the ranks meet on the loopback
    if one_host and shares_pid_namespace(t):
        for svc in services.values():
            join_namespaces(svc, network=own_network)
        services = {PIDNS_SERVICE: holder(t, NETWORK), **services}
    elif has_ps(t):  # a /dev/shm each: the PS makes no segment its workers could not map
        for svc in services.values():
            svc["environment"].update(TRANSPORT_ONLY)
    for name, svc in services.items() if one_host else ():
        if not svc.get("command"):  # the holder
            continue
        if has_ps(t):  # the PS, its shards and the workers
            private_exchange(svc, sockets=not t.network.publish_rpc_port)
        elif own_network:
            loopback_rendezvous(svc, name, t.cuda)
    services[TENSORBOARD_SERVICE] = _tensorboard(t)
    volumes = {STATE_VOLUME: state_volume(t)}
    if one_host and (has_ps(t) or own_network):
        volumes[EXCHANGE_VOLUME] = exchange_volume(t)
    if tracking.tracked_by_own_server(t):
        tracking.track_in_own_server(services[PS_SERVICE], t.tracking.auth)
        services[tracking.MLFLOW_SERVICE] = tracking.mlflow_service(t, NETWORK, APP_USER)
        volumes[tracking.MLFLOW_VOLUME] = tracking.mlflow_volume(t)
    return {
        "services": services,
        "networks": {NETWORK: {"driver": "bridge", "labels": {LABEL_PROJECT: t.name}}},
        "volumes": volumes,
    }


# The app's --exchange where the PS and its workers cannot share memory (each container has its
# own /dev/shm: same_host_copy off, Swarm, Kubernetes).
TRANSPORT_ONLY = {BY_NAME["exchange"].env: "transport"}


def state_volume(t: Topology) -> dict[str, Any]:
    """The named volume `state`: Docker's local driver by default, or `state.volume_driver`
    with its `driver_opts` (a shared volume, e.g. NFS: docs/multi-host.md)."""
    volume: dict[str, Any] = {}
    if t.state.volume_driver is not None:
        volume["driver"] = t.state.volume_driver
        if t.state.driver_opts:
            volume["driver_opts"] = {name: literal(value) for name, value in t.state.driver_opts.items()}
    volume["labels"] = {LABEL_PROJECT: t.name}
    return volume


def _ps(t: Topology) -> dict[str, Any]:
    svc = _builds(t, _common(t, 0, "ps", t.ps.shm_size, t.ps_gpu()))
    # The PS logs the run to MLflow where the compose (or stack) call has MLFLOW_TRACKING_URI
    # set (app.training.tracking); empty: no tracking. The experiment: the run's name.
    svc["environment"].update(MLFLOW_ENVIRONMENT)
    svc["environment"]["MLFLOW_EXPERIMENT_NAME"] = f"${{MLFLOW_EXPERIMENT_NAME:-{t.name}}}"
    svc["environment"].update(dict.fromkeys(tracking.FROM_CALLER))  # credentials: by name, never a value
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
        "build": {
            "context": ".",
            "dockerfile": DOCKERFILE,
            "args": {"BASE_IMAGE": literal(t.image.base), "PIP_SOURCE": t.image.pip_source},
        },
        **svc,
    }


def _worker(t: Topology, rank: int) -> dict[str, Any]:
    svc = _common(t, rank, "worker", t.workers.shm_size, t.worker_gpus()[rank - 1] if t.cuda else None)
    if has_ps(t):
        svc["depends_on"] = {PS_SERVICE: {"condition": "service_healthy"}}
    elif rank == 1:
        # Rank 0 of the DDP job: it makes the rendezvous and writes the checkpoints.
        svc = _builds(t, svc)
        if t.network.publish_rpc_port:
            svc["ports"] = [f"{t.ps.rpc_port}:{t.ps.rpc_port}"]
    else:
        # No healthcheck to wait for: the rendezvous waits (up to rpc_timeout) for all.
        svc["depends_on"] = {worker_name(1): {"condition": "service_started"}}
    # A lost peer fails every rank's step: each exits 1, comes back, and the job
    # resumes from rank 0's newest checkpoint.
    svc["restart"] = "on-failure"
    return svc


def _tensorboard(t: Topology) -> dict[str, Any]:
    """TensorBoard from the app's image on the runs' event files (the state volume, read-only),
    published on 127.0.0.1 only; started by `make tensorboard`, removed by `make down`."""
    return {
        "image": t.image_tag,
        "profiles": [TENSORBOARD_PROFILE],
        "entrypoint": ["python", "-m", "tensorboard.main"],
        "command": [
            "--logdir",
            f"{TENSORBOARD_ROOT}/${{{TENSORBOARD_RUN}:-}}",
            "--host",
            "0.0.0.0",  # inside the container; the host side is 127.0.0.1 (ports)
            "--port",
            str(TENSORBOARD_CONTAINER_PORT),
            "--load_fast",
            "false",  # the Python reader: it drops a restarted process's superseded points (purge_step)
        ],
        "labels": {LABEL_PROJECT: t.name, LABEL_ROLE: TENSORBOARD_SERVICE},
        "user": APP_USER,
        "init": True,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "networks": [NETWORK],
        "ports": [f"127.0.0.1:${{{TENSORBOARD_PORT}:-{TENSORBOARD_CONTAINER_PORT}}}:{TENSORBOARD_CONTAINER_PORT}"],
        "volumes": [{"type": "volume", "source": STATE_VOLUME, "target": STATE_DIR, "read_only": True}],
    }


def literal(text: str) -> str:
    """`text` as compose (and `docker stack deploy`) read it as it is: each `$` doubled, since
    both interpolate `$VAR` and `${VAR}` in every value of the file."""
    return text.replace("$", "$$")


def _common(t: Topology, rank: int, role: str, shm_size: int | str, gpu: Optional[int]) -> dict[str, Any]:
    env = app_environment(
        t,
        rank,
        master_addr=rendezvous_service(t),
        master_port=t.ps.rpc_port,
        data_dir=DATA_DIR,
        checkpoint_dir=CHECKPOINT_DIR,
        metrics_dir=METRICS_DIR,
        ifname=t.network.ifname,
        init_weights=INIT_WEIGHTS,
        cache_dir=CACHE_DIR,
        eval_dir=EVAL_DIR,
    )
    env = {name: literal(value) for name, value in env.items()}  # the topology's strings, as given
    volumes: list[dict[str, Any]] = []
    for source, target in ((t.data_source(), DATA_DIR), (t.eval_source(), EVAL_DIR)):
        if source is not None:  # a URL is not mounted: the app reads it as given
            volumes.append(_bind(source, target))
    if t.code is not None:
        # Mounted, not copied into the image: edit and run again without a rebuild.
        volumes.append(_bind(t.code, CODE_DIR))
        env["PYTHONPATH"] = f"{APP_DIR}:{CODE_DIR}"
    if t.train.init_weights is not None:
        volumes.append(
            {
                "type": "bind",
                "source": literal(_bind_source(t.train.init_weights)),
                "target": INIT_WEIGHTS,
                "read_only": True,
            }
        )
    volumes.append({"type": "volume", "source": STATE_VOLUME, "target": STATE_DIR})
    # The run's id and --resume, from the environment of the compose / stack call (orchestrator.runs):
    # the file stays the same from run to run.
    env.update(runs.interpolated())
    env[STOP_FILE_ENV] = STOP_FILE
    for name in t.job_env():  # the topology's `env` (and AWS_* for s3:// data): names only, each from the caller
        env[name] = None  # type: ignore[assignment]
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
        svc["deploy"] = {
            "resources": {
                "reservations": {
                    "devices": [
                        {"driver": "nvidia", "device_ids": [str(gpu)], "capabilities": ["gpu"]},
                    ]
                }
            }
        }
    elif t.cuda:
        # The CUDA base image says NVIDIA_VISIBLE_DEVICES=all: on a host whose default
        # runtime is nvidia, a service without a GPU would otherwise see every GPU.
        env["NVIDIA_VISIBLE_DEVICES"] = "void"
    return svc


def _bind(path: str, target: str) -> dict[str, Any]:
    """A read-only bind mount of the host's `path` at `target`."""
    return {"type": "bind", "source": literal(_bind_source(path)), "target": target, "read_only": True}


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
            f"network.publish_rpc_port: {'the PS' if has_ps(t) else worker_name(1)}'s port {t.ps.rpc_port} "
            "is published on every host address; "
            + (
                "each connection must prove the run's secret (CURVE) before a message is read, yet anyone may "
                "try it and load the PS"
                if has_ps(t)
                else "the DDP rendezvous (a c10d TCPStore) has no authentication"
            )
            + ": firewall it"
        )
    return out


def dump(doc: dict[str, Any], name: str, overrides: tuple[str, ...] = ()) -> str:
    """The compose file as text; the same document gives the same bytes. `overrides`: the
    command line's KEY=VALUE the topology was loaded with, recorded in the header."""
    header = (
        f"# Rendered from the topology {name!r} by `python -m orchestrator render`.\n"
        "# Do not edit: change configs/*.yaml and render again; add your own with `up -f FILE` (compose merges it).\n"
    )
    return header + overrides_line(overrides) + yaml_text(doc)


def overrides_line(overrides: tuple[str, ...]) -> str:
    """The header's record of the command line's overrides ("" for none), one comment line
    whatever they hold (a value with a space, a newline or a quote is written as Python's repr)."""
    if not overrides:
        return ""
    shown = (o if o.isprintable() and not any(c in o for c in " '\"#") else repr(o) for o in overrides)
    return f"# With the overrides: {' '.join(shown)}\n"
