"""doctor's checks for the swarm target: the `docker stack` CLI, the swarm itself,
placement constraints, where the PS's state lives, GPUs as the nodes' generic resources
and the NVIDIA runtime as dockerd's default; then the shared ones."""

from __future__ import annotations

from functools import partial
from typing import Any

from orchestrator.doctor import checks as shared
from orchestrator.doctor.checks import NVIDIA_FIX, Check, CheckFn
from orchestrator.doctor.facts import Facts, tool
from orchestrator.render import swarm as render_swarm
from orchestrator.topology.model import Topology


def nodes(f: Facts) -> list[dict[str, Any]]:
    """The swarm's nodes (backends.swarm.adapter.nodes), when this engine is a manager."""
    return list(f.target.get("nodes") or [])


def check_stack_cli(t: Topology, f: Facts) -> Check:
    cli = f.target.get("stack_cli")
    if cli is None:
        return Check(
            "docker stack",
            False,
            "no docker CLI with `docker stack`",
            "install the Docker CLI (docker.io / docker-ce-cli)",
        )
    return Check("docker stack", True, f"{cli} stack")


def check_swarm(t: Topology, f: Facts) -> Check:
    if f.daemon_error is not None:
        return Check("swarm", None, "not checked: no daemon")
    sw = f.info.get("Swarm") or {}
    state = sw.get("LocalNodeState") or "inactive"
    if state == "inactive":
        return Check(
            "swarm",
            False,
            "this engine is not in a swarm",
            "`docker swarm init` (this host), or `docker swarm join` (docs/multi-host.md)",
        )
    if state != "active":
        return Check(
            "swarm",
            False,
            f"swarm state {state} {sw.get('Error') or ''}".strip(),
            "`docker swarm leave --force`, then init or join again",
        )
    if not sw.get("ControlAvailable"):
        return Check(
            "swarm",
            False,
            "this node is a swarm worker; stacks are deployed from a manager",
            "run on a manager (`docker node ls` there), or `docker node promote` this one",
        )
    up = ready(nodes(f))
    return Check("swarm", True, f"active, manager; {len(up)} of {len(nodes(f)) or sw.get('Nodes', 0)} node(s) ready")


def check_placement(t: Topology, f: Facts) -> Check:
    given = [("swarm.ps", t.swarm.ps)] + [
        (f"swarm.workers (worker{r})", n) for r, n in enumerate(t.worker_nodes(), start=1)
    ]
    wanted = [(where, n) for where, n in given if n is not None]
    if not wanted:
        return Check("placement", True, "any node (no swarm.ps / swarm.workers)")
    if f.daemon_error is not None or not nodes(f):
        return Check("placement", None, "not checked: no swarm nodes to compare with")
    up = ready(nodes(f))
    for where, node in wanted:
        if not any(matches(node, n) for n in up):
            names = ", ".join(n["hostname"] for n in up) or "none"
            return Check(
                "placement",
                False,
                f"{where}: no ready node matches {node!r} (ready nodes: {names})",
                "name an existing node, or `docker node update --label-add KEY=VALUE NODE`",
            )
    return Check("placement", True, f"every constraint matches a ready node ({len(wanted)} checked)")


def check_state(t: Topology, f: Facts) -> Check:
    """Where the PS's checkpoints live on Swarm, and why the PS runs where it does
    (orchestrator.render.swarm pins it to the manager on a swarm of several nodes)."""
    volume = f"volume {t.name}_state"
    if t.state.shared:
        return Check(
            "state",
            True,
            f"{volume} on driver {t.state.volume_driver} (shared): a PS moved to "
            "another node resumes from its checkpoints",
        )
    if t.swarm.ps is not None:
        return Check(
            "state", True, f"the PS runs on swarm.ps {t.swarm.ps}: its checkpoints stay in that node's {volume}"
        )
    if not render_swarm.pins_state(t, len(nodes(f))):
        if not nodes(f):
            return Check("state", True, f"{volume}: one node, or not known yet (stack-up asks the engine)")
        return Check("state", True, f"one node: the PS's checkpoints stay in its {volume}")
    managers = [n for n in nodes(f) if n.get("role") == "manager"]
    if nodes(f) and not ready(managers):
        return Check(
            "state",
            False,
            f"the PS is pinned to the manager ({len(nodes(f))} nodes, no swarm.ps) but no manager is ready and active",
            "`docker node update --availability active MANAGER`, or set "
            "swarm.ps, or a shared state.volume_driver (docs/multi-host.md)",
        )
    several = f"; {len(managers)} managers: set swarm.ps to keep it on one" if len(managers) > 1 else ""
    return Check(
        "state",
        True,
        f"the PS is pinned to the manager (node.role==manager): {volume} is local "
        "to each node, so a PS moved elsewhere would start from nothing (swarm.ps or a "
        f"shared state.volume_driver choose otherwise){several}",
    )


def check_nvidia(t: Topology, f: Facts) -> Check:
    if not t.cuda:
        return Check("nvidia", True, f"not needed (image.device: {t.image.device})")
    if f.daemon_error is not None:
        return Check("nvidia", None, "not checked: no daemon")
    runtimes = f.info.get("Runtimes") or {}
    if "nvidia" not in runtimes:
        if not this_node_gpus(t, f):
            return Check(
                "nvidia",
                True,
                "this node gives no GPUs; each GPU node needs the NVIDIA runtime as its default (docs/multi-host.md)",
            )
        return Check("nvidia", False, "image.device is cuda, but this Docker engine has no NVIDIA runtime", NVIDIA_FIX)
    if f.info.get("DefaultRuntime") != "nvidia":
        return Check(
            "nvidia",
            False,
            "the NVIDIA runtime is not dockerd's default (Swarm services cannot pick a runtime)",
            'set "default-runtime": "nvidia" in /etc/docker/daemon.json and restart dockerd',
        )
    return Check("nvidia", True, "NVIDIA runtime present (default)")


def check_gpus(t: Topology, f: Facts) -> Check:
    if not t.cuda:
        return Check("gpus", True, "not needed")
    kind = t.swarm.gpu_resource
    need = t.workers.count + (1 if t.ps_gpu() is not None else 0)
    if not nodes(f):
        return Check("gpus", None, f"not checked: no swarm nodes to count {kind!r} resources on")
    have = sum(n["resources"].get(kind, 0) for n in ready(nodes(f)))
    if have < need:
        return Check(
            "gpus",
            False,
            f"the swarm's ready nodes advertise {have} generic resource(s) {kind!r}; the topology reserves {need}",
            f'on each GPU node: "node-generic-resources": ["{kind}=GPU-<uuid>", ...] in '
            "/etc/docker/daemon.json, restart dockerd (docs/multi-host.md)",
        )
    return Check("gpus", True, f"{have} {kind!r} advertised by the swarm, {need} reserved")


def this_node_gpus(t: Topology, f: Facts) -> bool:
    kinds = f.info.get("GenericResources") or []
    return any(
        ((r.get("NamedResourceSpec") or r.get("DiscreteResourceSpec") or {}).get("Kind") == t.swarm.gpu_resource)
        for r in kinds
    )


def ready(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [n for n in nodes if n.get("state") == "ready" and n.get("availability") == "active"]


def matches(constraint: str, node: dict[str, Any]) -> bool:
    if "=" in constraint:
        key, value = constraint.split("=", 1)
        return node.get("labels", {}).get(key) == value
    return node.get("hostname") == constraint


CHECKS: list[CheckFn] = [
    shared.check_daemon,
    check_stack_cli,
    check_swarm,
    check_placement,
    check_state,
    check_nvidia,
    check_gpus,
    partial(shared.check_shm, where="tmpfs /dev/shm", one_host=False),
    partial(shared.check_data, where="every node that runs a worker needs it at the same path"),
    shared.check_disk,
    shared.check_port,
]


def gather_facts(t: Topology, client: Any, facts: Facts, probe: bool) -> dict[str, Any]:
    """The docker CLI with `docker stack`; the swarm's nodes when this engine is a manager."""
    from orchestrator.backends.swarm import adapter

    found: dict[str, Any] = {"stack_cli": tool("docker", "stack", "--help", expect="deploy")}
    if client is not None and adapter.swarm_state(facts.info)["manager"]:
        found["nodes"] = adapter.nodes(client)
    return {"target": found}
