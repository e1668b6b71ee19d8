"""The compose render's namespaces of one job on one host, and its private exchange.

A `pidns` holder service (as a Kubernetes pod's pause container) whose PID and IPC namespaces
the job's containers join: a PS job's with `network.same_host_copy` (the PS's shared memory is
every worker's), and an allreduce job's always on one host, which share its network namespace
too (`network_mode: service:pidns`): the holder alone is on the project's bridge, the DDP ranks
reach one another on the loopback (Gloo, NCCL), and their rendezvous is a c10d FileStore on the
`exchange` volume (app/allreduce/filestore.py) instead of a TCPStore, which would listen on every
address of the namespace, the bridge's too. Nothing of the job then listens on the bridge.

The `exchange` volume: a tmpfs only the job's containers mount, 0700 and the app user's, holding
a PS job's secret and UNIX sockets, or an allreduce job's rendezvous files; they go when the
job's last container stops.
"""

from __future__ import annotations

from typing import Any

from app.option_table import BY_NAME
from orchestrator.render.shm_sizing import compose_size, shared_shm_bytes
from orchestrator.topology.model import Topology
from orchestrator.topology.services import LABEL_PROJECT, LABEL_ROLE, PIDNS_SERVICE, has_ps

EXCHANGE_VOLUME = "exchange"
EXCHANGE_DIR = "/run/psc"
EXCHANGE_SECRET = f"{EXCHANGE_DIR}/secret"
APP_USER = "1000:1000"  # psc, created by images/Dockerfile
LOOPBACK, LOOPBACK_IFNAME = "127.0.0.1", "lo"


def own_network_namespace(t: Topology) -> bool:
    """Whether the job's workers share the holder's network namespace (strategy allreduce on one
    host, unless `network.publish_rpc_port` asks for worker1's TCPStore on a published port)."""
    return not has_ps(t) and not t.network.publish_rpc_port


def shares_pid_namespace(t: Topology) -> bool:
    """Whether the job's processes share one PID namespace and one IPC namespace, the holder's:
    a PS job's with `network.same_host_copy` (app.exchange.ps_end: pushes and replies as
    memory, as between local processes), an allreduce job's with its network namespace
    (NCCL, which then sees one host, may use /dev/shm between the ranks). The holder sees
    when every process of the job has left."""
    return (t.network.same_host_copy and has_ps(t)) or own_network_namespace(t)


def holder(t: Topology, network: str) -> dict[str, Any]:
    """The service that holds the shared namespaces: tini as PID 1 reaps every orphan,
    `python -m app.pidns` waits and exits 0 once every other process of the job has left. Its
    /dev/shm is the job's (sized for all of it: orchestrator.render.shm_sizing), and it outlives
    a restarted PS or worker, so a process that comes back finds the namespaces the others are
    in. No capability, no mount, no GPU; no network but an allreduce job's (`network`, the
    project's bridge: outbound traffic and the project's DNS), where nothing listens."""
    svc: dict[str, Any] = {
        "image": t.image_tag,
        "entrypoint": ["python", "-m", "app.pidns"],
        "labels": {LABEL_PROJECT: t.name, LABEL_ROLE: PIDNS_SERVICE},
        "user": APP_USER,
        "init": True,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "network_mode": "none",
        "ipc": "shareable",
        "shm_size": compose_size(shared_shm_bytes(t)),
        # It exits 0 when the job is over; a failure of its own takes the namespaces with it.
        "restart": "on-failure",
    }
    if own_network_namespace(t):
        del svc["network_mode"]
        svc["networks"] = [network]
    if t.cuda:
        svc["environment"] = {"NVIDIA_VISIBLE_DEVICES": "void"}
    return svc


def join_namespaces(svc: dict[str, Any], network: bool) -> None:
    """`svc` in the holder's IPC namespace (its /dev/shm: the container's own shm_size no
    longer applies) and PID namespace, and (`network`) its network namespace, with no
    capability added. PID 1 of the namespace is the holder's tini, which reaps orphans, so
    the service needs no init of its own: its `python -m app` is the container's process
    and gets compose's SIGTERM directly."""
    svc["pid"] = f"service:{PIDNS_SERVICE}"
    svc["ipc"] = f"service:{PIDNS_SERVICE}"
    svc.pop("shm_size", None)
    svc["init"] = False
    svc["depends_on"] = {PIDNS_SERVICE: {"condition": "service_started"}, **svc.get("depends_on", {})}
    if network:
        svc.pop("networks", None)
        svc["network_mode"] = f"service:{PIDNS_SERVICE}"


def private_exchange(svc: dict[str, Any], sockets: bool) -> None:
    """`svc` on a PS job's private exchange: the volume, the secret and (`sockets`) the UNIX
    sockets in it; without them (a published port) the PS listens on TCP, encrypted (CURVE)."""
    svc["volumes"].append({"type": "volume", "source": EXCHANGE_VOLUME, "target": EXCHANGE_DIR})
    svc["environment"][BY_NAME["secret_file"].env] = EXCHANGE_SECRET
    if sockets:
        svc["environment"][BY_NAME["socket_dir"].env] = EXCHANGE_DIR


def loopback_rendezvous(svc: dict[str, Any], name: str, cuda: bool) -> None:
    """An allreduce rank (service `name`) in the holder's network namespace: its rendezvous
    files on the exchange volume (--socket_dir), Gloo and NCCL on the loopback, the master
    127.0.0.1. NCCL_HOSTID: the containers now share one host name, and NCCL would take them
    for one node (and try its shared-memory transports, with GPUs each container cannot see);
    a host id each keeps its socket transport between them, as in containers of their own."""
    svc["volumes"].append({"type": "volume", "source": EXCHANGE_VOLUME, "target": EXCHANGE_DIR})
    env = svc["environment"]
    env[BY_NAME["socket_dir"].env] = EXCHANGE_DIR
    env[BY_NAME["master_addr"].env] = LOOPBACK
    env["GLOO_SOCKET_IFNAME"] = LOOPBACK_IFNAME
    if cuda:
        env["NCCL_SOCKET_IFNAME"] = LOOPBACK_IFNAME
        env["NCCL_HOSTID"] = name


def exchange_volume(t: Topology) -> dict[str, Any]:
    """The tmpfs volume of the private exchange (see EXCHANGE_VOLUME), the app user's, 0700."""
    uid, gid = APP_USER.split(":")
    return {
        "driver": "local",
        "driver_opts": {"type": "tmpfs", "device": "tmpfs", "o": f"uid={uid},gid={gid},mode=0700,size=1m"},
        "labels": {LABEL_PROJECT: t.name},
    }
