"""The backend interface: every target behind one `Backend` (orchestrator/backends/base.py),
named once in the registry. The CLI builds `--target` and the lifecycle verbs from it, doctor
runs the target's own list, and neither compares a target's name: a new target is one
module and one registry line (shown here with a made-up one)."""

from __future__ import annotations

import ast
import io
from pathlib import Path
from typing import Any, Optional

import pytest

from orchestrator.backends import registry
from orchestrator.backends.base import LIFECYCLE, Backend
from orchestrator.backends.kubernetes import doctor as k8s_doctor
from orchestrator.cli import build_parser
from orchestrator.doctor.checks import Check, run_checks
from orchestrator.doctor.facts import Facts, gather
from orchestrator.doctor.report import report
from orchestrator.render import compose as render_compose
from orchestrator.render import kubernetes as render_k8s
from orchestrator.render import swarm as render_swarm
from orchestrator.topology.model import load, parse

from orch_helpers import REPO, cli  # noqa: F401 - cli is a fixture

SMOKE = REPO / "configs/cpu-smoke.yaml"
DEFAULT = REPO / "configs/default.yaml"


def test_the_registry_names_the_three_targets_and_their_files() -> None:
    assert list(registry.BACKENDS) == ["compose", "swarm", "kubernetes"] and registry.DEFAULT == "compose"
    assert {b.output for b in registry.BACKENDS.values()} == {"compose.yaml", "stack.yaml", "kubernetes.yaml"}
    for name, backend in registry.BACKENDS.items():
        assert backend.name == name and isinstance(backend, Backend) and backend.checks()


def test_each_backend_renders_what_its_render_module_does(tmp_path: Path) -> None:
    t = load(SMOKE)
    assert registry.get("compose").render(t, str(tmp_path)) == render_compose.dump(render_compose.render(t), t.name)
    assert registry.get("swarm").render(t, str(tmp_path)) == render_swarm.dump(
        render_swarm.render(t, data_root=str(tmp_path)), t.name
    )
    assert registry.get("kubernetes").render(t, str(tmp_path)) == render_k8s.dump(
        render_k8s.render(t, data_root=str(tmp_path)), t.name
    )


def test_an_unknown_target_is_one_line_naming_the_choices() -> None:
    with pytest.raises(Exception, match="--target: got 'nomad'; one of compose, swarm, kubernetes"):
        registry.get("nomad")


def test_the_cli_makes_each_targets_lifecycle_verbs() -> None:
    verbs = set(build_parser()._subparsers._group_actions[0].choices)
    assert {f"{p}{v}" for p in ("", "stack-") for v in LIFECYCLE} <= verbs
    assert not any(v.startswith("kubernetes") or v.startswith("k8s") for v in verbs)  # no verb talks to a cluster


def test_render_target_kubernetes_writes_kubernetes_yaml(cli, tmp_path: Path) -> None:  # noqa: F811
    status, out, err = cli("render", "-c", str(DEFAULT), "--workers", "3", "--target", "kubernetes")
    assert status == 0, err
    assert out.startswith("wrote kubernetes.yaml: ps + 3 workers") and "job resnet18-imagenette" in out
    t = load(DEFAULT).with_workers(3)
    assert (tmp_path / "kubernetes.yaml").read_text() == render_k8s.dump(
        render_k8s.render(t, data_root=str(tmp_path)), t.name
    )


def test_neither_the_cli_nor_doctor_compares_target_names() -> None:
    names = set(registry.BACKENDS)
    files = [REPO / "orchestrator/cli.py", *sorted((REPO / "orchestrator/doctor").glob("*.py"))]
    found = [
        f"{f.relative_to(REPO)}:{node.lineno}: {node.value!r}"
        for f in files
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not found, "target names in the CLI or doctor:\n" + "\n".join(found)


# --- a new target: one class and one registry line ------------------------------


class FakeBackend(Backend):
    name = "fake"
    output = "fake.txt"
    noun = "fleet"
    summary = "fake (a made-up target)"
    verb_prefix = "fake-"
    engine = False
    verb_help = {v: f"fake {v}" for v in LIFECYCLE}

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def render(self, t, data_root: str) -> str:
        return f"fleet {t.name} of {t.workers.count}\n"

    def name_of(self, t) -> str:
        return f"fleet-{t.name}"

    def checks(self):
        return [lambda t, f: Check("fleet", True, f"{f.target['ships']} ships")]

    def gather_facts(self, t, client, facts: Facts, probe: bool) -> dict[str, Any]:
        return {"target": {"ships": t.workers.count}}

    def up(self, config: str, workers: Optional[int], **kw: Any) -> int:
        self.calls.append(("up", dict(kw, config=config, workers=workers)))
        return 0

    def status(self, config, workers, **kw: Any) -> int:
        self.calls.append(("status", dict(kw, config=config, workers=workers)))
        return 0


def test_a_new_target_is_one_class_and_one_registry_line(cli, monkeypatch, tmp_path: Path) -> None:  # noqa: F811
    fake = FakeBackend()
    monkeypatch.setitem(registry.BACKENDS, "fake", fake)
    status, out, err = cli("render", "-c", str(SMOKE), "--target", "fake", "--workers", "4")
    assert status == 0, err
    assert (tmp_path / "fake.txt").read_text() == "fleet cpu-smoke of 4\n" and "fleet fleet-cpu-smoke" in out
    status, out, _ = cli("doctor", "-c", str(SMOKE), "--target", "fake")
    assert status == 0 and "ok       fleet         2 ships" in out and "doctor: all 1 checks passed" in out
    assert cli("fake-up", "-c", str(SMOKE), "--workers", "3", "--resume")[0] == 0
    assert fake.calls[-1] == (
        "up",
        {"config": str(SMOKE), "workers": 3, "strategy": None, "offline": False, "resume": True},
    )
    assert cli("fake-status")[0] == 0 and fake.calls[-1][0] == "status"
    status, _, err = cli("fake-down")
    assert status == 2 and "target fake has no down verb" in err


# --- the kubernetes target's doctor: offline ------------------------------------


def k8s_facts(**target: Any) -> Facts:
    return Facts(target={"kubectl": "/usr/bin/kubectl", "manifests": (5, []), **target})


def k8s_checks(t, f: Facts) -> dict[str, Check]:
    return {c.name: c for c in run_checks(registry.get("kubernetes").checks(), t, f)}


def test_kubernetes_doctor_passes_offline_with_what_needs_a_cluster_not_run() -> None:
    t = parse(SMOKE.read_text(), "c.yaml")
    checks = k8s_checks(t, k8s_facts())
    assert all(c.passed for c in checks.values()), checks
    assert "5 objects valid for Kubernetes 1.37.0" in checks["manifests"].text
    gpu = k8s_checks(parse(DEFAULT.read_text().replace("./data/imagenette2/val", str(REPO)), "d.yaml"), k8s_facts())
    assert gpu["gpus"].not_run and "3 x nvidia.com/gpu" in gpu["gpus"].text
    out = io.StringIO()
    assert report(list(gpu.values()), out) and "1 not run (gpus)" in out.getvalue()


def test_kubernetes_doctor_problems_kubectl_and_invalid_manifests() -> None:
    t = parse(SMOKE.read_text(), "c.yaml")
    checks = k8s_checks(t, k8s_facts(kubectl=None, manifests=(5, ["Job x-ps: spec.template: bad", "Service y: z"])))
    assert checks["kubectl"].ok is False and "install kubectl" in checks["kubectl"].fix
    assert checks["manifests"].ok is False and checks["manifests"].text == "Job x-ps: spec.template: bad (and 1 more)"
    absent = k8s_checks(t, k8s_facts(manifests=None))["manifests"]
    assert absent.not_run and "pip install kubernetes-validate" in absent.text


def test_kubernetes_doctor_data_on_a_claim_is_not_run_and_a_host_path_is_checked() -> None:
    base = DEFAULT.read_text()
    claim = parse(base + "kubernetes: {data_claim: imagenette}\n", "d.yaml")
    assert k8s_checks(claim, k8s_facts())["data"].not_run
    host = parse(base, "d.yaml")
    c = k8s_checks(host, Facts(data_dir="/x", data_problem="is empty", target={"kubectl": "k"}))["data"]
    assert c.ok is False and "is empty" in c.text


def test_kubernetes_doctor_validates_the_real_render_for_three_workers(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    t = load(DEFAULT).with_workers(3)
    f = gather(t, engine=False, target=registry.get("kubernetes").gather_facts)
    assert f.target["manifests"] == (5, [])
    broken = render_k8s.render(t, data_root=str(tmp_path))
    broken[2]["spec"]["template"]["spec"]["gpus"] = 1  # no such field: strict validation refuses it
    count, errors = k8s_doctor.validate(broken)
    assert count == 5 and len(errors) == 1 and errors[0].startswith(f"Job {broken[2]['metadata']['name']}: ")


def test_scale_refuses_allreduce_and_swarm_in_one_line(tmp_path: Path) -> None:
    from orchestrator.backends.compose import verbs
    from orchestrator.errors import UsageError

    config = tmp_path / "t.yaml"
    config.write_text(
        Path(SMOKE).read_text().replace("strategy: async", "strategy: allreduce").replace("name: cpu-smoke", "name: t")
    )
    with pytest.raises(UsageError, match="strategy allreduce has a fixed world size; .* RESUME=1") as e:
        verbs.scale(str(config), 3)
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="stack-scale: a running stack is not scaled yet") as e:
        registry.get("swarm").scale(None, 3)
    assert "\n" not in str(e.value)
