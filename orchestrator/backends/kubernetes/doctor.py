"""doctor's checks for the kubernetes target, all offline: no verb talks to a cluster,
so what needs one (the GPUs the device plugin offers, the storage class, whether the
CNI enforces NetworkPolicy) is reported as not run, with the command that tells."""

from __future__ import annotations

import os
from typing import Any

from orchestrator.doctor import checks as shared
from orchestrator.doctor.checks import SHM_FOR_LOADER, Check, CheckFn
from orchestrator.doctor.facts import Facts, tool
from orchestrator.render import kubernetes as render_kubernetes
from orchestrator.topology.model import Topology, size_bytes
from orchestrator.topology.services import has_ps

VALIDATE_VERSION = "1.37.0"  # the Kubernetes version the manifests are validated against (kubernetes-validate)


def check_kubectl(t: Topology, f: Facts) -> Check:
    kubectl = f.target.get("kubectl")
    if kubectl is None:
        return Check(
            "kubectl",
            False,
            "no kubectl on PATH: the manifests are applied with `kubectl apply -f`",
            "install kubectl (https://kubernetes.io/docs/tasks/tools/)",
        )
    return Check("kubectl", True, f"{kubectl} (client only; no cluster is asked)")


def check_manifests(t: Topology, f: Facts) -> Check:
    result = f.target.get("manifests")
    if result is None:
        return Check(
            "manifests",
            True,
            "not validated offline: `pip install kubernetes-validate` to check them "
            f"against Kubernetes {VALIDATE_VERSION}",
            ran=False,
        )
    count, errors = result
    if errors:
        return Check(
            "manifests",
            False,
            f"{errors[0]} (and {len(errors) - 1} more)" if len(errors) > 1 else errors[0],
            "fix the topology field it names",
        )
    return Check(
        "manifests", True, f"{count} objects valid for Kubernetes {VALIDATE_VERSION} (kubernetes-validate, strict)"
    )


def check_gpus(t: Topology, f: Facts) -> Check:
    if not t.cuda:
        return Check("gpus", True, "not needed")
    return Check(
        "gpus",
        True,
        f"{t.workers.count} x {render_kubernetes.GPU_RESOURCE} asked for, one per worker; "
        "not checked offline: `kubectl describe nodes | grep nvidia.com/gpu` (the NVIDIA device plugin)",
        ran=False,
    )


def check_shm(t: Topology, f: Facts) -> Check:
    worker = size_bytes(t.workers.shm_size)
    if t.train.loader_workers != "auto" and t.train.loader_workers and worker < SHM_FOR_LOADER:
        return Check(
            "shm",
            False,
            f"workers.shm_size {t.workers.shm_size} is too small for {t.train.loader_workers} DataLoader worker(s)",
            "set workers.shm_size to 256m or more (2g for ImageNet-sized batches)",
        )
    return Check(
        "shm",
        True,
        f"/dev/shm a memory emptyDir: {t.workers.shm_size} per worker, {t.ps.shm_size} for "
        "the PS, counted against each pod's memory",
    )


def check_data(t: Topology, f: Facts) -> Check:
    if t.reads_files and t.kubernetes.data_claim is not None:
        return Check(
            "data",
            True,
            f"train.data_dir from PersistentVolumeClaim {t.kubernetes.data_claim}: "
            "not checked offline (`kubectl get pvc`)",
            ran=False,
        )
    return shared.check_data(t, f, where="a hostPath: every node that runs a pod needs it at this path")


def check_state(t: Topology, f: Facts) -> Check:
    name = f"{render_kubernetes.object_name(t)}-state"
    cls = t.kubernetes.storage_class or "the cluster's default storage class"
    mode = "ReadWriteMany (every allreduce rank mounts it)" if not has_ps(t) else "ReadWriteOnce"
    return Check("state", True, f"PersistentVolumeClaim {name}: {t.kubernetes.state_size}, {mode}, from {cls}")


def check_port(t: Topology, f: Facts) -> Check:
    return Check(
        "rpc port",
        True,
        f"{t.ps.rpc_port} reachable only from the job's own pods (NetworkPolicy "
        f"{render_kubernetes.object_name(t)}-rpc; a CNI that enforces NetworkPolicy keeps it so)",
    )


CHECKS: list[CheckFn] = [check_kubectl, check_manifests, check_gpus, check_shm, check_data, check_state, check_port]


def gather_facts(t: Topology, client: Any, facts: Facts, probe: bool) -> dict[str, Any]:
    """kubectl (its client only), and the rendered manifests validated offline when
    kubernetes-validate is installed: (objects, errors) under `manifests`."""
    found: dict[str, Any] = {"kubectl": tool("kubectl", "version", "--client")}
    docs = render_kubernetes.render(t, data_root=os.getcwd())
    found["manifests"] = validate(docs)
    return {"target": found}


def validate(docs: list[dict[str, Any]]) -> Any:
    """(objects, one line per error) from kubernetes-validate in strict mode; None when it
    is not installed."""
    try:
        import kubernetes_validate
    except ImportError:
        return None
    errors = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, VALIDATE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path) or "(top)"
            errors.append(f"{doc['kind']} {doc['metadata']['name']}: {where}: {e.message}")
    return (len(docs), errors)
