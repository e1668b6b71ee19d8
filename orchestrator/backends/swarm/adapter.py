"""Thin adapter over Docker Swarm: `docker stack` command lines and the reads
of services, tasks and logs (Docker SDK).

Pure functions build argv lists and turn task records into states; the rest
only asks Docker. Facts it relies on (Docker 20.10 daemon, 28.x CLI):
- `docker stack deploy --resolve-image never` uses the image already on each
  node (no registry is asked for a digest);
- a stack's services, networks, volumes and containers carry the label
  `com.docker.stack.namespace=<stack>`;
- a one-shot task ends in state `complete` (exit 0) or `failed` (its exit
  code in Status.ContainerStatus.ExitCode); a retry is a new task of the same
  slot; `stack rm` returns before the containers and the network are gone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from orchestrator.backends.base import ServiceState
from orchestrator.errors import EngineError
from orchestrator.metrics.records import metrics_from_tar
from orchestrator.render.compose import METRICS_DIR
from orchestrator.topology.services import LABEL_PROJECT, described

LABEL_STACK = "com.docker.stack.namespace"
DOCKER = "docker"
# Task states after which a task never runs again (a retry is a new task).
TERMINAL = frozenset({"complete", "failed", "shutdown", "rejected", "orphaned", "remove"})


# --- command lines (pure) -------------------------------------------------


def deploy_argv(stack: str, file: str) -> list[str]:
    return [DOCKER, "stack", "deploy", "--resolve-image", "never", "--prune", "-c", file, stack]


def rm_argv(stack: str) -> list[str]:
    return [DOCKER, "stack", "rm", stack]


def logs_argv(stack: str, service: str, *, follow: bool, extra: Sequence[str] = ()) -> list[str]:
    """One service's log, each line prefixed `<stack>_<service>.<slot>@<node> |`; `extra`: more
    of its flags (--timestamps, --tail N, --since X: docker service logs takes compose's)."""
    return [
        DOCKER,
        "service",
        "logs",
        "--no-task-ids",
        *(["-f"] if follow else []),
        *extra,
        service_name(stack, service),
    ]


def service_name(stack: str, service: str) -> str:
    return f"{stack}_{service}"


def ignored_options(output: str) -> list[str]:
    """The lines where `docker stack deploy` says it ignores keys of the stack file."""
    return [line.strip() for line in output.splitlines() if "Ignoring" in line]


def swarm_state(info: dict[str, Any]) -> dict[str, Any]:
    """From `docker info`: is this engine in a swarm, and a manager of it?"""
    sw = info.get("Swarm") or {}
    return {
        "state": sw.get("LocalNodeState") or "inactive",
        "manager": bool(sw.get("ControlAvailable")),
        "nodes": sw.get("Nodes") or 0,
        "error": sw.get("Error") or "",
    }


def task_state(service: str, tasks: Sequence[dict[str, Any]]) -> ServiceState:
    """A service's state from its tasks (newest last counts). A terminal task is
    `exited` with its exit code; `restarts` counts the failed tasks before it."""
    if not tasks:
        return ServiceState(service, "no task")
    ordered = sorted(tasks, key=lambda t: (t.get("CreatedAt") or "", (t.get("Version") or {}).get("Index", 0)))
    last = ordered[-1]
    status = last.get("Status") or {}
    task = status.get("State") or "unknown"
    exit_code = (status.get("ContainerStatus") or {}).get("ExitCode")
    if task == "complete":
        exit_code = 0
    return ServiceState(
        service,
        "exited" if task in TERMINAL else task,
        exit_code=exit_code if task in TERMINAL else None,
        restarts=len(ordered) - 1,
        task=task,
        error=status.get("Err") or "",
    )


# --- Docker reads (SDK) ---------------------------------------------------


def services(client: Any, stack: str) -> dict[str, Any]:
    """The stack's services by their name in the stack file (`ps`, `worker1`, ...)."""
    found = client.services.list(filters={"label": f"{LABEL_STACK}={stack}"})
    prefix = f"{stack}_"
    return {s.name[len(prefix) :] if s.name.startswith(prefix) else s.name: s for s in found}


def states(client: Any, stack: str) -> dict[str, ServiceState]:
    """The state of each service of the stack, by service name, with what the service is
    (its container labels and environment: role, rank, shard)."""
    return {
        name: task_state(name, svc.tasks()).with_spec(described(name, *_labels_env(svc.attrs), None))
        for name, svc in services(client, stack).items()
    }


def _labels_env(attrs: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    spec = ((attrs.get("Spec") or {}).get("TaskTemplate") or {}).get("ContainerSpec") or {}
    return spec.get("Labels") or {}, dict(e.split("=", 1) for e in spec.get("Env") or [] if "=" in e)


def running_env(client: Any, stack: str, names: Sequence[str]) -> dict[str, str]:
    """The variables `names` as the stack's services have them, while one of its tasks has
    not ended ({} otherwise): a `stack-up` while a run goes on keeps its id, so Swarm
    restarts no task."""
    found = services(client, stack)
    if not found or all_ended(states(client, stack), list(found)):
        return {}
    for svc in found.values():
        _, env = _labels_env(svc.attrs)
        if env.get(names[0]):
            return {n: env.get(n, "") for n in names}
    return {}


def read_metrics(client: Any, stack: str, service: str) -> dict[str, list[str]]:
    """{file name: lines} of the metrics files a service's newest container on this engine
    sees at /state/metrics (running or exited); {} when none is here (a task on another
    node: ask that node's engine)."""
    found = client.containers.list(
        all=True,
        filters={"label": f"com.docker.swarm.service.name={service_name(stack, service)}"},
        ignore_removed=True,  # a task's container removed between the listing and its inspect
    )
    for container in sorted(found, key=lambda c: c.attrs.get("Created", ""), reverse=True):
        try:
            stream, _ = container.get_archive(METRICS_DIR)
            return metrics_from_tar(b"".join(stream))
        except Exception:  # noqa: BLE001 - gone meanwhile, or no metrics yet
            continue
    return {}


def leftovers(client: Any, stack: str) -> list[str]:
    """What of the stack still exists: services, containers, networks (not volumes)."""
    label = {"label": f"{LABEL_STACK}={stack}"}
    return (
        [f"service {s.name}" for s in client.services.list(filters=label)]
        + [f"container {c.name}" for c in client.containers.list(all=True, filters=label, ignore_removed=True)]
        + [f"network {n.name}" for n in client.networks.list(filters=label)]
    )


def wait_gone(client: Any, stack: str, timeout: float = 120, every: float = 1.0) -> list[str]:
    """After `stack rm`: wait until no service, container or network of the stack
    is left (then its volume can go); what is left at the timeout."""
    deadline = time.monotonic() + timeout
    left = leftovers(client, stack)
    while left and time.monotonic() < deadline:
        time.sleep(every)
        left = leftovers(client, stack)
    return left


def remove_volumes(client: Any, stack: str) -> list[str]:
    """Remove the stack's volumes on this node; their names."""
    removed = []
    for v in client.volumes.list(filters={"label": f"{LABEL_STACK}={stack}"}):
        try:
            v.remove()
        except Exception as e:  # noqa: BLE001 - in use: say which
            raise EngineError(f"cannot remove volume {v.name}: {e}") from None
        removed.append(v.name)
    return removed


def nodes(client: Any) -> list[dict[str, Any]]:
    """Every node of the swarm (a manager is asked): hostname, role, state, labels, GPUs."""
    out = []
    for n in client.nodes.list():
        a = n.attrs
        desc = a.get("Description") or {}
        out.append(
            {
                "hostname": desc.get("Hostname", "?"),
                "role": (a.get("Spec") or {}).get("Role", "?"),
                "availability": (a.get("Spec") or {}).get("Availability", "?"),
                "state": (a.get("Status") or {}).get("State", "?"),
                "labels": (a.get("Spec") or {}).get("Labels") or {},
                "resources": generic_resources((desc.get("Resources") or {}).get("GenericResources") or []),
            }
        )
    return out


def generic_resources(specs: Sequence[dict[str, Any]]) -> dict[str, int]:
    """{kind: count} of a node's advertised generic resources (named ones count 1 each)."""
    out: dict[str, int] = {}
    for spec in specs:
        named, discrete = spec.get("NamedResourceSpec"), spec.get("DiscreteResourceSpec")
        if named:
            out[named["Kind"]] = out.get(named["Kind"], 0) + 1
        elif discrete:
            out[discrete["Kind"]] = out.get(discrete["Kind"], 0) + int(discrete.get("Value", 0))
    return out


def all_ended(states: dict[str, ServiceState], names: Sequence[str]) -> bool:
    """Every named service's newest task has ended."""
    return all(s in states and states[s].ended for s in names)


def replace_secret(client: Any, stack: str, name: str, data: str) -> None:
    """The Docker secret `name` made anew with `data` (one an earlier run of the stack left goes
    first: a secret cannot change), labelled with the stack's project."""
    remove_secret(client, name)
    client.secrets.create(name=name, data=data.encode(), labels={LABEL_PROJECT: stack})


def remove_secret(client: Any, name: str) -> None:
    """The Docker secret `name` removed, if there is one (the `name` filter matches prefixes)."""
    for found in client.secrets.list(filters={"name": name}):
        if found.name == name:
            found.remove()
