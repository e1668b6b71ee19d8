"""The Kubernetes render (`render --target kubernetes`): whole-document golden files,
every manifest valid for a pinned Kubernetes version under `kubernetes-validate
--strict` (the API's own OpenAPI schemas, unknown fields rejected) and loadable into
the `kubernetes` client's models, and what the manifests must say. No cluster runs
here: nothing is applied."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import kubernetes
import kubernetes_validate
import pytest
import yaml

from orchestrator.render import compose as render_compose
from orchestrator.render import kubernetes as render_k8s
from orchestrator.topology.model import Topology, TopologyError, load, parse

from orch_helpers import HERE, REPO

GOLDEN = HERE / "golden"
DATA_ROOT = "/srv/ps-compose"
K8S_VERSION = "1.37.0"  # the Kubernetes version the manifests are validated for (kubernetes-validate 1.37.0)

# The GPU run placed by node labels, with the data on a claim and a storage class.
PLACED = (
    (REPO / "configs/default.yaml").read_text()
    + """
kubernetes:
  state_size: 50g
  storage_class: fast-ssd
  data_claim: imagenette
  ps_node_selector: {kubernetes.io/hostname: ps-host}
  worker_node_selector: {nvidia.com/gpu.present: "true"}
"""
)
PLACED = PLACED.replace("  # gpu: 0 ", "  gpu: 0 ")

CASES = [
    ("kubernetes-default-workers3.yaml", "configs/default.yaml", 3, None),
    ("kubernetes-placed.yaml", PLACED, None, None),
    ("kubernetes-cpu-smoke.yaml", "configs/cpu-smoke.yaml", None, None),
    ("kubernetes-cpu-smoke-shards2.yaml", "configs/cpu-smoke.yaml", 4, "shards"),
    ("kubernetes-cpu-smoke-allreduce.yaml", "configs/cpu-smoke.yaml", 3, "allreduce"),
    ("kubernetes-custom-example.yaml", "examples/custom/topology.yaml", None, None),
]
IDS = [c[0] for c in CASES]
KINDS = {
    "PersistentVolumeClaim": "V1PersistentVolumeClaim",
    "Service": "V1Service",
    "Job": "V1Job",
    "NetworkPolicy": "V1NetworkPolicy",
}


def topo(config: str, workers: Optional[int] = None, variant: Optional[str] = None) -> Topology:
    t = parse(config, "placed.yaml") if "\n" in config else load(REPO / config)
    if workers is not None:
        t = t.with_workers(workers)
    if variant == "allreduce":
        t = t.with_strategy("allreduce")
    if variant == "shards":
        t = t.model_copy(update={"ps": dataclasses.replace(t.ps, shards=2)})
    return t


def rendered(config: str, workers: Optional[int] = None, variant: Optional[str] = None) -> str:
    t = topo(config, workers, variant)
    return render_k8s.dump(render_k8s.render(t, data_root=DATA_ROOT), t.name)


def documents(*case: Any) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(rendered(*case)))


@pytest.mark.parametrize("golden,config,workers,variant", CASES, ids=IDS)
def test_golden(golden: str, config: str, workers: Optional[int], variant: Optional[str]) -> None:
    text = rendered(config, workers, variant)
    path = GOLDEN / golden
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"no {path}: run with UPDATE_GOLDEN=1 (tests/orchestrator/README.md)"
    assert text == path.read_text(), f"kubernetes render differs from {path}; if intended: UPDATE_GOLDEN=1"


@pytest.mark.parametrize("golden,config,workers,variant", CASES, ids=IDS)
def test_every_manifest_is_valid_for_the_pinned_kubernetes(golden, config, workers, variant) -> None:
    for doc in documents(config, workers, variant):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("golden,config,workers,variant", CASES, ids=IDS)
def test_every_manifest_loads_into_the_client_models(golden, config, workers, variant) -> None:
    api = kubernetes.client.ApiClient()
    for doc in documents(config, workers, variant):
        model = api._ApiClient__deserialize(doc, KINDS[doc["kind"]])
        # What the model read back is what was written (a misspelt key would be dropped).
        assert api.sanitize_for_serialization(model) == doc


def test_strict_validation_rejects_an_unknown_field() -> None:
    # The check above can fail: a field the API does not have is an error under --strict.
    job = next(d for d in documents("configs/cpu-smoke.yaml") if d["kind"] == "Job")
    job["spec"]["template"]["spec"]["containers"][0]["shmSize"] = "1Gi"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_the_validator_cli_passes_the_default_topology_with_3_workers(tmp_path: Path) -> None:
    # As the docs tell a user to check a rendered file (the CLI, on the file the CLI wrote).
    out = tmp_path / "k8s.yaml"
    r = subprocess.run(
        [sys.executable, "-m", "orchestrator", "render", "--target", "kubernetes", "--workers", "3", "-o", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    validator = Path(sys.executable).with_name("kubernetes-validate")
    r = subprocess.run(
        [str(validator), "--strict", "-k", K8S_VERSION, str(out)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" passed for resource ") == 5, r.stdout


# --- what the manifests say --------------------------------------------------


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def container(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]["containers"][0]


def env(job: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(job)["env"]}


def test_workers_are_one_indexed_job_with_a_gpu_each_and_no_rank_of_their_own() -> None:
    docs = documents("configs/default.yaml", 3)
    ps, workers = by_kind(docs, "Job")
    assert workers["spec"]["completionMode"] == "Indexed"
    assert workers["spec"]["completions"] == workers["spec"]["parallelism"] == 3
    assert container(workers)["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "PSC_RANK" not in env(workers)  # the app takes it from JOB_COMPLETION_INDEX
    assert "nvidia.com/gpu" not in container(ps)["resources"]["limits"]  # the PS runs on CPU
    assert env(ps)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert workers["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert workers["spec"]["backoffLimitPerIndex"] == 3


def test_every_training_variable_of_the_compose_render_reaches_the_pods() -> None:
    t = topo("configs/default.yaml", 3)
    compose_env = render_compose.render(t)["services"]["worker1"]["environment"]
    k8s_env = env(by_kind(documents("configs/default.yaml", 3), "Job")[1])
    host_only = ("PSC_RANK", "PSC_RUN_ID", "PSC_RESUME", "PSC_MASTER_ADDR", "PSC_SECRET_FILE", "PSC_SOCKET_DIR")
    # a restarted pod's container is a new one: nothing of the last start's filesystem to keep a mistake in
    host_only += ("PSC_STOP_FILE",)
    expected = {k: v for k, v in compose_env.items() if k not in host_only}
    assert {k: v for k, v in k8s_env.items() if k in expected} == expected
    assert k8s_env["PSC_MASTER_ADDR"] == "resnet18-imagenette-ps"
    # Pods on several nodes: TCP (CURVE) with the run's secret from a Secret, no UNIX sockets.
    assert k8s_env["PSC_SECRET_FILE"] == f"{render_k8s.SECRET_DIR}/{render_k8s.SECRET_KEY}"
    assert "PSC_SOCKET_DIR" not in k8s_env


def test_the_ps_state_is_a_claim_and_the_run_is_the_ps_job() -> None:
    docs = documents("configs/default.yaml", 3)
    (claim,) = by_kind(docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    ps, workers = by_kind(docs, "Job")
    volumes = {v["name"]: v for v in ps["spec"]["template"]["spec"]["volumes"]}
    assert volumes["state"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert env(ps)["PSC_RUN_ID"] == {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}
    # A finished PS is not started again: a Job's pod that exits 0 completes it.
    assert ps["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    worker_volumes = {v["name"]: v for v in workers["spec"]["template"]["spec"]["volumes"]}
    assert worker_volumes["state"] == {"name": "state", "emptyDir": {}}
    assert worker_volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert worker_volumes["data"]["hostPath"] == {"path": f"{DATA_ROOT}/data/imagenette2/val", "type": "Directory"}


def test_the_rendezvous_is_a_headless_service_on_index_0() -> None:
    (svc,) = by_kind(documents("configs/default.yaml", 3), "Service")
    assert svc["metadata"]["name"] == "resnet18-imagenette-ps"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {
        "batch.kubernetes.io/job-name": "resnet18-imagenette-ps",
        "batch.kubernetes.io/job-completion-index": "0",
    }
    (svc,) = by_kind(documents("configs/cpu-smoke.yaml", 3, "allreduce"), "Service")
    assert svc["spec"]["selector"]["batch.kubernetes.io/job-name"] == "cpu-smoke-workers"
    assert svc["metadata"]["name"] == "cpu-smoke-worker1"


def test_the_security_posture_of_the_compose_file() -> None:
    for job in by_kind(documents("configs/default.yaml", 3), "Job"):
        pod = job["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 1000
        assert container(job)["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        }
        # writable: /state, /dev/shm and /tmp alone
        writable = {m["mountPath"] for m in container(job)["volumeMounts"] if not m.get("readOnly")}
        assert writable == {"/state", "/dev/shm", "/tmp"}
    (policy,) = by_kind(documents("configs/default.yaml", 3), "NetworkPolicy")
    own = {"matchLabels": {"ps-compose.project": "resnet18-imagenette"}}
    assert policy["spec"] == {
        "podSelector": own,
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": own}]}],
    }


def test_node_selectors_claims_and_shards() -> None:
    docs = documents(PLACED)
    ps, workers = by_kind(docs, "Job")
    assert ps["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "ps-host"}
    assert workers["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert container(ps)["resources"]["limits"]["nvidia.com/gpu"] == "1"  # ps.gpu: 0
    (claim,) = by_kind(docs, "PersistentVolumeClaim")
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    data = {v["name"]: v for v in workers["spec"]["template"]["spec"]["volumes"]}["data"]
    assert data["persistentVolumeClaim"] == {"claimName": "imagenette", "readOnly": True}

    ps = by_kind(documents("configs/cpu-smoke.yaml", 4, "shards"), "Job")[0]
    assert ps["spec"]["completions"] == 2  # the PS and its shard, one index each
    assert ps["spec"]["template"]["spec"]["affinity"]["podAffinity"]


def test_a_bad_kubernetes_key_is_one_line_naming_it() -> None:
    from orchestrator.topology.model import TopologyError

    text = (REPO / "configs/cpu-smoke.yaml").read_text() + "kubernetes:\n  data_claim: Not_A_Name\n"
    with pytest.raises(TopologyError) as e:
        parse(text, "k.yaml")
    assert str(e.value).startswith("k.yaml: kubernetes.data_claim: got 'Not_A_Name'; ")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("size,expected", [("2g", "2Gi"), ("512m", "512Mi"), (1000, "1000"), ("1.5g", "1536Mi")])
def test_quantity(size, expected) -> None:
    assert render_k8s.quantity(size) == expected


def test_every_pod_requests_cpu_and_memory_so_the_ps_is_never_best_effort(write_config) -> None:
    for job in by_kind(documents("configs/cpu-smoke.yaml", 2), "Job"):
        resources = container(job)["resources"]
        # ps and workers: shm_size 256m + 4 GiB; memory limited to its request, no CPU limit (Burstable)
        assert resources == {"requests": {"cpu": "1", "memory": "4352Mi"}, "limits": {"memory": "4352Mi"}}
    doc = yaml.safe_load((REPO / "configs/cpu-smoke.yaml").read_text())
    doc["kubernetes"] = {"ps_cpu": 2, "ps_memory": "6g", "worker_cpu": 0.5, "worker_memory": "3g"}
    t = load(write_config(doc))
    ps, workers = by_kind(render_k8s.render(t, data_root="/x"), "Job")
    assert container(ps)["resources"]["requests"] == {"cpu": "2", "memory": "6Gi"}
    assert container(workers)["resources"] == {
        "requests": {"cpu": "500m", "memory": "3Gi"},
        "limits": {"memory": "3Gi"},
    }
    doc["kubernetes"] = {"worker_memory": "200m"}
    with pytest.raises(
        TopologyError, match=r"kubernetes.worker_memory: got '200m'; must be more than workers.shm_size"
    ):
        load(write_config(doc))
