"""The kubernetes target: `render --target kubernetes` writes manifests (PS Job on a
PersistentVolumeClaim behind a headless Service, workers as an Indexed Job, a
NetworkPolicy: orchestrator/render/kubernetes.py) for `kubectl apply -f`. No verb
talks to a cluster; doctor checks what can be checked offline."""

from __future__ import annotations

from orchestrator.backends.base import Backend
from orchestrator.backends.kubernetes import doctor
from orchestrator.render import kubernetes
from orchestrator.topology.model import Topology


class KubernetesBackend(Backend):
    name = "kubernetes"
    output = "kubernetes.yaml"
    doctor = doctor
    noun = "job"
    summary = "kubernetes (manifests for kubectl apply -f)"
    verb_prefix = None
    engine = False

    def render(self, t: Topology, data_root: str) -> str:
        return kubernetes.dump(kubernetes.render(t, data_root=data_root), t.name, t.overrides)

    def name_of(self, t: Topology) -> str:
        return kubernetes.object_name(t)


BACKEND = KubernetesBackend()
