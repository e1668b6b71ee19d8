"""The services of a running or rendered cluster, read back: from the document `up` wrote
(a compose file, or a stack file: the same format and labels), and from `docker inspect`
of a container (labels, environment, device requests)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from orchestrator.topology.services import Service, described


def from_compose(doc: Mapping[str, Any]) -> list[Service]:
    """The services of a rendered compose document (a compose.yaml `up` wrote)."""
    out = []
    for name, svc in (doc.get("services") or {}).items():
        devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
        ids = [i for d in devices for i in d.get("device_ids") or []]
        s = described(name, svc.get("labels") or {}, svc.get("environment") or {}, int(ids[0]) if ids else None)
        if s is not None:
            out.append(s)
    return out


def from_container(attrs: Mapping[str, Any], service_label: str) -> Optional[Service]:
    """The service a container (`docker inspect` attrs) runs; its name is the compose
    service label `service_label`."""
    config = attrs.get("Config") or {}
    labels = config.get("Labels") or {}
    name = labels.get(service_label)
    if name is None:
        return None
    env = dict(e.split("=", 1) for e in config.get("Env") or [] if "=" in e)
    requests = (attrs.get("HostConfig") or {}).get("DeviceRequests") or []
    ids = [i for r in requests for i in r.get("DeviceIDs") or []]
    return described(name, labels, env, int(ids[0]) if ids and ids[0].isdigit() else None)
