"""Topology -> stack file for `docker stack deploy` (Docker Swarm, one or more hosts).

Pure, like `orchestrator.render.compose.render`: it takes the compose document of the same
topology and rewrites what Swarm does differently (facts checked on Docker
20.10 with the 28.x CLI):

- no `build` (a stack deploys images already on each node), no `depends_on`
  (Swarm has no start order: a worker that cannot join the PS in time exits
  1, and `restart_policy: on-failure` starts it again after a delay, a few
  times at most); `restart: on-failure` becomes that restart policy, no
  `restart` becomes `condition: none` (tasks are one-shot: never restarted
  after success, which Swarm's default policy `any` would do);
- `shm_size` is ignored by Swarm: a tmpfs of the same size at /dev/shm;
- GPUs: `reservations.devices` is rejected; each GPU service reserves one
  generic resource of kind `swarm.gpu_resource`, which the node's dockerd
  advertises (`node-generic-resources`); the NVIDIA runtime reads the assigned
  id from DOCKER_RESOURCE_<KIND> (docs/multi-host.md). `workers.gpus` does not
  apply: Swarm picks a free GPU of the node;
- `endpoint_mode: dnsrr`: `ps` resolves to the PS task's own address (the
  overlay's virtual-IP routing fails on some kernels, and the PS is one task);
  the same for `worker1`, the rendezvous of strategy allreduce (no PS);
- no healthcheck: nothing waits on it without `depends_on`, a task's name
  resolves only once it is healthy (the PS resolves its own name to join), and
  Swarm kills a task that turns unhealthy (a PS still loading a big dataset);
- a published RPC port (only when asked) is in `mode: host` (ingress needs VIP);
- `security_opt` is ignored by Swarm (no-new-privileges is then the daemon's
  `"no-new-privileges": true`); the rest of the hardening stays (non-root
  user, `cap_drop: [ALL]`, `init`);
- placement: `swarm.ps` / `swarm.workers` become `deploy.placement.constraints`;
  `PSC_HOST_WORKERS` (what `loader_workers: auto` divides a host's CPUs by) is
  the number of workers placed on a named node, all of them otherwise;
- the state: the volume `state` is local to each node (unless `state.volume_driver`
  makes it a share), so a PS moved to another node would start from nothing. When the
  swarm has more than one node (the topology names several, or `nodes`, the engine's
  count at stack-up, says so), the services that write it (the PS and its shards; under
  allreduce worker1) without a placement of their own get `node.role==manager`:
  the node that deploys, since only a manager deploys. For a single-manager swarm that
  is exactly one node, known before deploying and the same in every render (a hostname
  would tie the file to one engine, and both nodes of a swarm on one machine may report
  the same hostname); with several managers it may be any of them, and `doctor` says to
  set `swarm.ps`;
- relative bind sources (`train.data_dir`) become absolute under `data_root`:
  `docker stack deploy` sends them to other nodes as they are;
- the run's secret (a PS job): the Docker secret `<stack>_exchange`, which stack-up makes
  anew before each deploy and stack-down removes, readable by the app user alone in each
  task (/run/secrets/psc_exchange, 0400); the tasks talk over TCP on the overlay, each
  connection proving the secret and encrypted (CURVE), no UNIX socket (the tasks may be on
  different nodes).
"""

from __future__ import annotations

import posixpath
from typing import Any

from orchestrator.render import compose, tracking
from orchestrator.render.yamlio import yaml_text
from orchestrator.topology.model import Topology, size_bytes
from orchestrator.topology.services import LABEL_PROJECT, LABEL_RANK, has_ps, rendezvous_service
from orchestrator.topology.services import services as service_list

MANAGER = "node.role==manager"  # where the state's writer goes on a multi-node swarm (see above)
STACK_VERSION = "3.8"  # the newest 3.x schema Docker 20.10's `docker stack` knows
SHM_DIR = "/dev/shm"
# compose `restart: on-failure` -> this; no `restart` -> never restarted. Never after success.
ON_FAILURE = {"condition": "on-failure", "delay": "10s", "max_attempts": 3, "window": "30s"}
NO_RESTART = {"condition": "none"}
# Compose keys `docker stack deploy` ignores or rejects; replaced below.
# group_add too: `docker stack deploy` rejects it (docker/cli#3777); docs/gpu.md says what to do instead.
SECRET = "exchange"  # the stack's name for the run's secret (the swarm's: `secret_name`)
SECRET_TARGET = "psc_exchange"  # /run/secrets/<this> in each task
SECRET_FILE = f"/run/secrets/{SECRET_TARGET}"
_NOT_IN_SWARM = (
    "build",
    "depends_on",
    "restart",
    "shm_size",
    "security_opt",
    "ports",
    "deploy",
    "healthcheck",
    "group_add",
)


def stack_name(t: Topology) -> str:
    """The stack's name: services are <stack>_ps, <stack>_worker1, ..."""
    return t.name


def secret_name(t: Topology) -> str:
    """The Docker secret that holds a run's secret (made by stack-up, one per stack)."""
    return f"{stack_name(t)}_{SECRET}"


def pins_state(t: Topology, nodes: int = 0) -> bool:
    """The state's writers go to the manager: a swarm of several nodes (`t` names several,
    or `nodes`, the engine's count, is > 1; 0: unknown), and no shared state volume."""
    return not t.state.shared and (t.spans_nodes() or nodes > 1)


def state_writers(t: Topology) -> list[str]:
    """The services that write the state volume's checkpoints: the PS and its shards, or
    (allreduce) worker1, DDP's rank 0."""
    if not has_ps(t):
        return [rendezvous_service(t)]
    return [s.name for s in service_list(t) if s.rank == 0]


def render(t: Topology, *, data_root: str, nodes: int = 0) -> dict[str, Any]:
    """The whole stack document for `t` (pure: no I/O). `data_root` is the
    absolute directory a relative `train.data_dir` is taken from; `nodes` the swarm's
    node count when known (stack-up asks the engine; 0: decide from `t` alone)."""
    tracking.refuse_own_server(t, "swarm")
    doc = compose.render(t, one_host=False)
    pinned = state_writers(t) if pins_state(t, nodes) else []
    services = {}
    for name, svc in doc["services"].items():
        if name == compose.TENSORBOARD_SERVICE:  # compose only: a stack has no profiles to keep it stopped
            continue
        rank = int(svc["labels"][LABEL_RANK])
        services[name] = _service(t, svc, rank, data_root, name == rendezvous_service(t), name in pinned)
    stack = {
        "version": STACK_VERSION,
        "services": services,
        "networks": {compose.NETWORK: {"driver": "overlay", "labels": {LABEL_PROJECT: t.name}}},
        "volumes": doc["volumes"],
    }
    if has_ps(t):
        stack["secrets"] = {SECRET: {"external": True, "name": secret_name(t)}}
    return stack


def _service(
    t: Topology, compose_svc: dict[str, Any], rank: int, data_root: str, rendezvous: bool, pinned: bool
) -> dict[str, Any]:
    svc = {k: v for k, v in compose_svc.items() if k not in _NOT_IN_SWARM}
    shm = compose_svc["shm_size"]
    svc["volumes"] = [_absolute(v, data_root) for v in svc["volumes"]] + [
        {"type": "tmpfs", "target": SHM_DIR, "tmpfs": {"size": size_bytes(shm)}},
    ]
    deploy: dict[str, Any] = {
        "mode": "replicated",
        "replicas": 1,
        "endpoint_mode": "dnsrr",
        "restart_policy": dict(ON_FAILURE if compose_svc.get("restart") == "on-failure" else NO_RESTART),
        "labels": dict(svc["labels"]),
    }
    node = t.swarm.ps if rank == 0 else t.worker_nodes()[rank - 1]
    if "PSC_HOST_WORKERS" in svc["environment"] and node is not None and "=" not in node:
        # A named node holds only the workers placed on it; a label or no placement: all may land together.
        on_node = max(1, t.worker_nodes().count(node))
        svc["environment"] = {**svc["environment"], "PSC_HOST_WORKERS": str(on_node)}
    if node is not None:
        deploy["placement"] = {"constraints": [constraint(node)]}
    elif pinned:
        deploy["placement"] = {"constraints": [MANAGER]}
    gpu = t.ps_gpu() is not None if rank == 0 else t.cuda
    if gpu:
        deploy["resources"] = {
            "reservations": {
                "generic_resources": [
                    {"discrete_resource_spec": {"kind": t.swarm.gpu_resource, "value": 1}},
                ]
            }
        }
    svc["deploy"] = deploy
    if has_ps(t):
        uid, gid = compose.APP_USER.split(":")
        svc["secrets"] = [{"source": SECRET, "target": SECRET_TARGET, "uid": uid, "gid": gid, "mode": 0o400}]
        svc["environment"] = {**svc["environment"], compose.BY_NAME["secret_file"].env: SECRET_FILE}
    if rendezvous and t.network.publish_rpc_port:
        svc["ports"] = [{"target": t.ps.rpc_port, "published": t.ps.rpc_port, "protocol": "tcp", "mode": "host"}]
    return svc


def constraint(node: str) -> str:
    """`swarm.ps`/`swarm.workers` entry -> placement constraint: key=value is a node label."""
    if "=" in node:
        key, value = node.split("=", 1)
        return f"node.labels.{key}=={value}"
    return f"node.hostname=={node}"


def _absolute(volume: dict[str, Any], data_root: str) -> dict[str, Any]:
    if volume["type"] != "bind" or posixpath.isabs(volume["source"]):
        return volume
    return {**volume, "source": posixpath.normpath(posixpath.join(compose.literal(data_root), volume["source"]))}


def dump(doc: dict[str, Any], name: str, overrides: tuple[str, ...] = ()) -> str:
    """The stack file as text (same document, same bytes); `overrides` as compose.dump's."""
    header = (
        f"# Stack file for `docker stack deploy`, rendered from the topology {name!r}\n"
        "# by `python -m orchestrator render --target swarm`. Do not edit: change configs/*.yaml.\n"
    )
    return header + compose.overrides_line(overrides) + yaml_text(doc)
