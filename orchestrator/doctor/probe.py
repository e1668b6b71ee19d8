"""The GPU probe: a short program run in the project's image as uid 1000 with the GPUs
the topology reserves; what it saw, parsed (pure), and `check_probe`'s verdict on it.
Used by the compose target's doctor and by `gpu-check`."""

from __future__ import annotations

import json
from typing import Any

from orchestrator.doctor.checks import NVIDIA_FIX, Check, gpu_paths, wanted_gpus
from orchestrator.doctor.facts import Facts, Probe, ProbeGPU
from orchestrator.render.compose import APP_USER
from orchestrator.topology.model import Topology

PROBE_MARK = "ps-compose-probe "


# Run as the image's user (uid 1000) with the topology's GPUs and group_add: opens every
# NVIDIA device node, then asks torch for each GPU's name and UUID. One marked JSON line.
PROBE_SCRIPT = (
    f"MARK = {PROBE_MARK!r}\n"
    + """
import glob, json, os, stat
out = {"uid": os.getuid(), "groups": os.getgroups(), "denied": [], "gpus": [], "error": ""}
for node in sorted(glob.glob("/dev/nvidia*")):
    if not os.path.exists(node) or not stat.S_ISCHR(os.stat(node).st_mode):
        continue
    try:
        os.close(os.open(node, os.O_RDWR))
    except OSError as e:
        out["denied"].append([node, e.strerror or str(e), os.stat(node).st_gid])
try:
    import torch
    if not torch.cuda.is_available():
        out["error"] = "torch.cuda.is_available() is False"
    for i in range(torch.cuda.device_count() if not out["error"] else 0):
        p = torch.cuda.get_device_properties(i)
        out["gpus"].append({"name": p.name, "uuid": "GPU-" + str(p.uuid)})
except Exception as e:
    out["error"] = (type(e).__name__ + ": " + " ".join(str(e).split()))[:200]
print(MARK + json.dumps(out), flush=True)
"""
)


def parse_probe(requested: list[int], output: str, exit_code: int) -> Probe:
    """The probe's verdict from its output (`requested`: the host GPU ids it was given,
    sorted; the container sees them as cuda:0.. in that order, CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    line = next((ln for ln in output.splitlines() if ln.startswith(PROBE_MARK)), None)
    if line is None:
        last = next((ln.strip() for ln in reversed(output.splitlines()) if ln.strip()), "no output")
        return Probe(
            requested,
            error=f"the probe container exited {exit_code} without a report: {last[:160]}",
            fix="see `docker logs` of the probe, or run with --no-probe",
        )
    data = json.loads(line[len(PROBE_MARK) :])
    denied = [(str(n), str(why), int(gid)) for n, why, gid in data.get("denied") or []]
    gpus = [ProbeGPU(gid, g["name"], g["uuid"]) for gid, g in zip(requested, data.get("gpus") or [])]
    probe = Probe(requested, gpus, data.get("uid"), denied)
    if data.get("error") and not denied:
        return Probe(
            requested,
            gpus,
            data.get("uid"),
            denied,
            error=f"in the probe container: {data['error']}",
            fix="check the driver (`nvidia-smi` on the host) and that image.base is a CUDA build of torch",
        )
    return probe


def probe_error(e: BaseException) -> Probe:
    """A probe the engine refused to start (e.g. no `nvidia` device driver, an unknown GPU id)."""
    text = " ".join(str(getattr(e, "explanation", None) or e).split())[:200]
    return Probe([], error=f"the engine did not start the probe container: {text}", fix=NVIDIA_FIX)


def check_probe(t: Topology, f: Facts) -> Check:
    """The probe container: the project's image, the GPUs the topology reserves, uid 1000."""
    if not t.cuda:
        return Check("probe", True, "not needed")
    if f.daemon_error is not None or not gpu_paths(f):
        return Check("probe", None, "not run: no way to give it a GPU (see nvidia)")
    if f.probe is None:
        return Check("probe", True, f.probe_note or "--no-probe; `make gpu-check` runs it", ran=False)
    p = f.probe
    if p.error:
        return Check("probe", False, p.error, p.fix)
    if p.denied:
        node, why, gid = p.denied[0]
        return Check(
            "probe",
            False,
            f"uid {p.uid} cannot open {node} in the container ({why}; its group is {gid})",
            f"add image.group_add: [{gid}] to the topology (the host group of {node})",
        )
    if len(p.gpus) != len(p.requested):
        return Check(
            "probe",
            False,
            f"the probe asked for GPU ids {p.requested} and saw {len(p.gpus)} GPU(s)",
            "check workers.gpus / ps.gpu against `nvidia-smi -L`",
        )
    seen = ", ".join(f"{g.id}: {g.name} ({g.uuid})" for g in p.gpus)
    return Check("probe", True, f"uid {p.uid} in {t.image_tag} sees GPU {seen}")


def run_probe(client: Any, t: Topology) -> Probe:
    """Run PROBE_SCRIPT in the topology's image with its GPUs and group_add (the container
    is removed); what it saw."""
    import docker

    requested = wanted_gpus(t)
    request = docker.types.DeviceRequest(
        driver="nvidia", device_ids=[str(g) for g in requested], capabilities=[["gpu"]]
    )
    container = None
    try:
        container = client.containers.create(
            t.image_tag,
            entrypoint=["python", "-c", PROBE_SCRIPT],
            user=APP_USER,
            environment={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
            device_requests=[request],
            group_add=[str(g) for g in t.image.group_add],
            labels={"ps-compose.probe": t.name},
        )
        container.start()
        code = container.wait(timeout=300).get("StatusCode", -1)
        output = container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
    except (docker.errors.DockerException, OSError) as e:  # OSError: requests' timeouts and resets
        return probe_error(e)
    finally:
        if container is not None:
            try:
                container.remove(force=True)
            except docker.errors.DockerException:
                pass
    return parse_probe(requested, output, code)
