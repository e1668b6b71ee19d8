"""Topology -> Kubernetes manifests (`render --target kubernetes`, then `kubectl apply -f`).

Pure, like the compose and swarm renders: `render(t, data_root=...)` returns the
list of objects as plain data; `dump` writes them as one multi-document YAML file.
The app's environment is the compose render's (`compose.app_environment`), so a
training option reaches a pod exactly as it reaches a container.

What the objects are, and why:
- PersistentVolumeClaim `<name>-state`: /state of the PS (checkpoints, final.pt,
  metrics). ReadWriteOnce; under allreduce every rank mounts it (each resumes from
  rank 0's checkpoint), so it is ReadWriteMany there.
- Job `<name>-ps`: the PS, and its shards as the other indexes (Indexed,
  completions = ps.shards; the app takes its shard from JOB_COMPLETION_INDEX).
  A Job, not a StatefulSet: a finished PS exits 0 and is not started again
  (a StatefulSet restarts every pod that exits); a PS that fails gets a new pod
  (`backoffLimitPerIndex`, with `restartPolicy: Never` as the API requires) that
  resumes from the claim. Shards share the PS's node (pod affinity), so a
  ReadWriteOnce claim serves them all.
- Job `<name>-workers`: workers 1..N as one Indexed Job (rank =
  JOB_COMPLETION_INDEX + 1), one `nvidia.com/gpu` each on cuda (the device plugin
  picks the GPU; `workers.gpus` does not apply), a failed worker replaced by a pod
  of the same index that rejoins. Their /state is the pod's own (emptyDir): only
  the PS's state is kept. A worker's metrics file (its `train` records) goes with
  its pod; the PS's records (evaluations, joins, the end) are on the claim.
- headless Service `<name>-ps` (`<name>-worker1` under allreduce: DDP's rank 0):
  the rendezvous name, resolving to index 0's pod IP (`clusterIP: None`, like
  Swarm's dnsrr). `publishNotReadyAddresses`: the PS resolves its own name before
  it listens.
- NetworkPolicy `<name>-rpc`: only the job's own pods reach its pods;
  `network.publish_rpc_port` exposes nothing here.
- The run's secret (a PS job): the Secret `<name>-exchange` (key `secret`), which the
  manifests only name (no secret is written into a rendered file): create it before
  `kubectl apply` (docs/multi-host.md). Mounted read-only at /run/secrets/psc, 0440 to the
  pod's fsGroup; every connection between the job's pods proves it and is encrypted (CURVE).
- The run's id is the PS Job's uid (the downward API's controller-uid label): a
  PS pod that is replaced keeps it and resumes its run; `kubectl delete` then
  `apply` is a new run that sets older checkpoints aside, as a new `make up` does.
- Every pod: uid/gid 1000, non-root, no privilege escalation, every capability
  dropped, the runtime's seccomp profile, a read-only root filesystem (the app
  writes to /state, /dev/shm and /tmp alone); /dev/shm a memory emptyDir of
  shm_size, /tmp an emptyDir. CPU and memory requested (kubernetes.ps_cpu,
  ps_memory, worker_cpu, worker_memory; memory default: shm_size + 4 GiB), memory
  limited to its request, no CPU limit: the PS is never BestEffort.
- Host paths (train.data_dir unless kubernetes.data_claim, code, init_weights)
  become hostPath volumes at absolute paths under `data_root`: they must exist on
  every node that runs a pod.
Kubernetes object names allow no '_': a topology name's '_' becomes '-'.
"""

from __future__ import annotations

import posixpath
from typing import Any, Optional

from orchestrator import runs
from orchestrator.render import compose, tracking
from orchestrator.render.yamlio import yaml_text
from orchestrator.topology.model import Topology, size_bytes
from orchestrator.topology.services import LABEL_PROJECT, LABEL_ROLE, has_ps

GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"
HOSTNAME_KEY = "kubernetes.io/hostname"
RETRIES = 3  # per index, as compose's and Swarm's on-failure restarts
STOP_GRACE_S = 30  # the PS writes its checkpoint on SIGTERM
APP_UID = 1000  # psc, created by images/Dockerfile
DEFAULT_MEMORY_HEADROOM = 4 * 1024**3  # a pod's memory beyond its /dev/shm unless kubernetes.*_memory says
TMP_SIZE = "1Gi"  # /tmp: the root filesystem is read-only
SECRET_KEY = "secret"  # the run's secret in the Secret `secret_name(t)`
SECRET_DIR = "/run/secrets/psc"


def object_name(t: Topology) -> str:
    """The prefix of every object's name: the topology's name, '_' as '-'."""
    return t.name.replace("_", "-")


def secret_name(t: Topology) -> str:
    """The Secret that holds the run's secret (made by the user: docs/multi-host.md)."""
    return f"{object_name(t)}-exchange"


def rendezvous_name(t: Topology) -> str:
    """The headless Service every process reaches rank 0 by (PSC_MASTER_ADDR)."""
    return f"{object_name(t)}-{'ps' if has_ps(t) else 'worker1'}"


def render(t: Topology, *, data_root: str) -> list[dict[str, Any]]:
    """The manifests of `t` (pure: no I/O), in the order `kubectl apply` creates them.
    `data_root` is the absolute directory relative host paths are taken from."""
    tracking.refuse_own_server(t, "kubernetes")
    name = object_name(t)
    docs = [_claim(t), _rendezvous_service(t)]
    if has_ps(t):
        docs.append(_job(t, f"{name}-ps", "ps", t.ps.shards, data_root))
    docs.append(_job(t, f"{name}-workers", "worker", t.workers.count, data_root))
    docs.append(_network_policy(t))
    return docs


def _labels(t: Topology, role: Optional[str] = None) -> dict[str, str]:
    labels = {LABEL_PROJECT: t.name}
    if role is not None:
        labels[LABEL_ROLE] = role
    return labels


def _meta(t: Topology, name: str, role: Optional[str] = None) -> dict[str, Any]:
    return {"name": name, "labels": _labels(t, role)}


def _claim(t: Topology) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce" if has_ps(t) else "ReadWriteMany"],
        "resources": {"requests": {"storage": quantity(t.kubernetes.state_size)}},
    }
    if t.kubernetes.storage_class is not None:
        spec["storageClassName"] = t.kubernetes.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(t, f"{object_name(t)}-state"),
        "spec": spec,
    }


def _rendezvous_service(t: Topology) -> dict[str, Any]:
    job = f"{object_name(t)}-{'ps' if has_ps(t) else 'workers'}"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(t, rendezvous_name(t)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_NAME_LABEL: job, INDEX_LABEL: "0"},
            "ports": [{"name": "rpc", "port": t.ps.rpc_port, "targetPort": t.ps.rpc_port}],
        },
    }


def _job(t: Topology, name: str, role: str, count: int, data_root: str) -> dict[str, Any]:
    pod_spec = _pod_spec(t, role, data_root)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(t, name, role),
        "spec": {
            "completionMode": "Indexed",
            "completions": count,
            "parallelism": count,
            "backoffLimitPerIndex": RETRIES,
            "template": {"metadata": {"labels": _labels(t, role)}, "spec": pod_spec},
        },
    }


def _pod_spec(t: Topology, role: str, data_root: str) -> dict[str, Any]:
    ps = role == "ps"
    volumes, mounts = _volumes(t, ps, data_root)
    container: dict[str, Any] = {
        "name": role,
        "image": t.image_tag,
        "imagePullPolicy": "IfNotPresent",
        "args": [role],
        "env": _env(t, ps),
        "resources": _resources(t, ps),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,  # the app writes to /state, /dev/shm and /tmp alone
        },
        "volumeMounts": mounts,
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the Job replaces a failed pod (backoffLimitPerIndex requires Never)
        "terminationGracePeriodSeconds": STOP_GRACE_S,
        "securityContext": {
            "runAsUser": APP_UID,
            "runAsGroup": APP_UID,
            "fsGroup": APP_UID,
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    if ps and t.ps.shards > 1:
        # The shards write their slices into the PS's claim: on its node (ReadWriteOnce).
        spec["affinity"] = {
            "podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {JOB_NAME_LABEL: f"{object_name(t)}-ps"}},
                        "topologyKey": HOSTNAME_KEY,
                    }
                ]
            }
        }
    selector = t.kubernetes.ps_node_selector if ps else t.kubernetes.worker_node_selector
    if selector:
        spec["nodeSelector"] = dict(selector)
    return spec


def _gpu(t: Topology, ps: bool) -> bool:
    return t.ps_gpu() is not None if ps else t.cuda


def _env(t: Topology, ps: bool) -> list[dict[str, Any]]:
    """The app's environment (the compose render's), the rank left to JOB_COMPLETION_INDEX, and
    the run's id from the Job for the processes that write checkpoints."""
    env = compose.app_environment(
        t,
        0 if ps else 1,
        master_addr=rendezvous_name(t),
        master_port=t.ps.rpc_port,
        data_dir=compose.DATA_DIR,
        checkpoint_dir=compose.CHECKPOINT_DIR,
        metrics_dir=compose.METRICS_DIR,
        ifname=t.network.ifname,
        init_weights=compose.INIT_WEIGHTS,
        cache_dir=compose.CACHE_DIR,
        eval_dir=compose.EVAL_DIR,
    )
    del env["PSC_RANK"]  # from JOB_COMPLETION_INDEX (app/config.py)
    if has_ps(t):
        env.update(compose.TRANSPORT_ONLY)  # a pod's /dev/shm is its own: no segment to share
        env[compose.BY_NAME["secret_file"].env] = f"{SECRET_DIR}/{SECRET_KEY}"
    if t.cuda and not _gpu(t, ps):
        env["NVIDIA_VISIBLE_DEVICES"] = "void"  # the CUDA image says all: no GPU for a pod without one
    if t.code is not None:
        env["PYTHONPATH"] = f"{compose.APP_DIR}:{compose.CODE_DIR}"
    env_list: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items()]
    for name in t.job_env():  # `env` (and AWS_* for s3:// data): from the Secret <name>-env, a key it lacks unset
        ref = {"name": f"{t.name}-env", "key": name, "optional": True}
        env_list.append({"name": name, "valueFrom": {"secretKeyRef": ref}})
    if ps or not has_ps(t):  # the processes that write checkpoints: the run is their Job
        env_list.append(
            {"name": runs.RUN_ID, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOB_UID_LABEL}']"}}}
        )
        env_list.append({"name": runs.RESUME, "value": "false"})
    return env_list


def _resources(t: Topology, ps: bool) -> dict[str, Any]:
    """CPU and memory requested (so the PS, which holds the run's state, is never BestEffort, the
    first evicted), memory limited to the request (the pod's /dev/shm counts in it), no CPU
    limit (a throttled PS slows every worker); one GPU on cuda."""
    k = t.kubernetes
    shm = t.ps.shm_size if ps else t.workers.shm_size
    memory = (k.ps_memory if ps else k.worker_memory) or size_bytes(shm) + DEFAULT_MEMORY_HEADROOM
    requests = {"cpu": _cores(k.ps_cpu if ps else k.worker_cpu), "memory": quantity(memory)}
    limits: dict[str, str] = {"memory": quantity(memory)}
    if _gpu(t, ps):
        limits[GPU_RESOURCE] = "1"
    return {"requests": requests, "limits": limits}


def _cores(cpu: float) -> str:
    """CPU cores as a Kubernetes quantity: '2', or millicores ('500m')."""
    return str(int(cpu)) if float(cpu).is_integer() else f"{round(cpu * 1000)}m"


def _volumes(t: Topology, ps: bool, data_root: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the container's mounts: /dev/shm and /tmp (memory), the data, the
    user's code and init weights (read-only), and /state (the claim, or the pod's own)."""
    shm = quantity(t.ps.shm_size if ps else t.workers.shm_size)
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "shm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}]
    if t.reads_files and (t.data_source() is not None or t.kubernetes.data_claim is not None):
        if t.kubernetes.data_claim is not None:
            volumes.append(
                {"name": "data", "persistentVolumeClaim": {"claimName": t.kubernetes.data_claim, "readOnly": True}}
            )
        else:
            volumes.append(_host_path("data", t.data_source() or t.data_dir(), data_root))
        mounts.append({"name": "data", "mountPath": compose.DATA_DIR, "readOnly": True})
    eval_source = t.eval_source()
    if eval_source is not None:
        volumes.append(_host_path("eval", eval_source, data_root))
        mounts.append({"name": "eval", "mountPath": compose.EVAL_DIR, "readOnly": True})
    if t.code is not None:
        volumes.append(_host_path("code", t.code, data_root))
        mounts.append({"name": "code", "mountPath": compose.CODE_DIR, "readOnly": True})
    if t.train.init_weights is not None:
        volumes.append(_host_path("init", t.train.init_weights, data_root, kind="File"))
        mounts.append({"name": "init", "mountPath": compose.INIT_WEIGHTS, "readOnly": True})
    if ps or not has_ps(t):
        volumes.append({"name": "state", "persistentVolumeClaim": {"claimName": f"{object_name(t)}-state"}})
    else:
        volumes.append({"name": "state", "emptyDir": {}})
    mounts.append({"name": "state", "mountPath": compose.STATE_DIR})
    if has_ps(t):
        volumes.append(
            {
                "name": "exchange",
                "secret": {
                    "secretName": secret_name(t),
                    "defaultMode": 0o440,
                    "items": [{"key": SECRET_KEY, "path": SECRET_KEY}],
                },
            }
        )
        mounts.append({"name": "exchange", "mountPath": SECRET_DIR, "readOnly": True})
    return volumes, mounts


def _host_path(name: str, path: str, data_root: str, kind: str = "Directory") -> dict[str, Any]:
    absolute = posixpath.normpath(posixpath.join(data_root, path)) if not posixpath.isabs(path) else path
    return {"name": name, "hostPath": {"path": absolute, "type": kind}}


def _network_policy(t: Topology) -> dict[str, Any]:
    own = {"matchLabels": {LABEL_PROJECT: t.name}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(t, f"{object_name(t)}-rpc"),
        "spec": {"podSelector": own, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": own}]}]},
    }


def quantity(size: int | str) -> str:
    """A topology size ('2g', '512m', bytes) as a Kubernetes quantity ('2Gi', '512Mi', bytes)."""
    n = size_bytes(size)
    for unit, factor in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def dump(docs: list[dict[str, Any]], name: str, overrides: tuple[str, ...] = ()) -> str:
    """The manifests as one multi-document YAML file (same documents, same bytes); `overrides`
    as compose.dump's."""
    header = (
        f"# Kubernetes manifests rendered from the topology {name!r}\n"
        "# by `python -m orchestrator render --target kubernetes`. Do not edit: change configs/*.yaml.\n"
        "# kubectl apply -f this file; docs/multi-host.md says what else the cluster needs.\n"
    )
    return header + compose.overrides_line(overrides) + "---\n".join(yaml_text(d) for d in docs)
