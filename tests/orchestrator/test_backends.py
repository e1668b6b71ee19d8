"""The backend interface: every target behind one `Backend` (orchestrator/backends/base.py),
named once in the registry. The CLI builds `--target` and the lifecycle verbs from it, doctor
runs the target's own list, and neither compares a target's name: a new target is one
module and one registry line (shown here with a made-up one)."""

from __future__ import annotations

import ast
import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orchestrator import paths
from orchestrator.backends import registry
from orchestrator.backends.base import Backend, ServiceState
from orchestrator.backends.kubernetes import doctor as k8s_doctor
from orchestrator.cli import build_parser
from orchestrator.doctor.checks import Check, run_checks
from orchestrator.doctor.facts import Facts, gather
from orchestrator.doctor.report import report
from orchestrator.render import compose as render_compose
from orchestrator.render import kubernetes as render_k8s
from orchestrator.render import swarm as render_swarm
from orchestrator.topology.model import load, parse
from orchestrator.topology.services import services

from orch_helpers import REPO, cli  # noqa: F401 - cli is a fixture

SMOKE = REPO / "configs/cpu-smoke.yaml"
DEFAULT = REPO / "configs/default.yaml"
LIFECYCLE = ("up", "down", "logs", "status", "smoke", "scale", "tensorboard", "export")  # every target's verbs


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
    files = [*sorted((REPO / "orchestrator/cli").glob("*.py")), *sorted((REPO / "orchestrator/doctor").glob("*.py"))]
    found = [
        f"{f.relative_to(REPO)}:{node.lineno}: {node.value!r}"
        for f in files
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not found, "target names in the CLI or doctor:\n" + "\n".join(found)


# --- a new target: its blocks, and one registry line ---------------------------


def end_records(workers: int) -> list[str]:
    joins = [
        json.dumps({"time": r, "role": "ps", "rank": 0, "event": "join", "step": r, "worker_rank": r, "workers": r})
        for r in range(1, workers + 1)
    ]
    end = {"time": 9, "role": "ps", "rank": 0, "event": "end", "step": 300, "accuracy": 0.95, "loss": 0.2}
    return joins + [json.dumps(end)]


class ReadLines:
    """Log lines already read: what the made-up target's log_iter gives."""

    def __init__(self, lines) -> None:
        self.lines = list(lines)
        self.returncode = 0

    def __iter__(self):
        return iter(self.lines)

    def close(self) -> None:
        pass


class FakeBackend(Backend):
    """A fleet of ships: one per service, sailing once deployed, home (exited 0) once looked at
    twice. Only the blocks: no verb of its own."""

    name = "fake"
    output = "fake.txt"
    noun = "fleet"
    summary = "fake (a made-up target)"
    verb_prefix = "fake-"
    engine = False
    record = "fake.json"
    unit = "ship"
    ended_well = "home"

    def __init__(self) -> None:
        self.ships: dict[str, ServiceState] = {}
        self.looks = 0
        self.calls: list[tuple[str, Any]] = []

    def render(self, t, data_root: str) -> str:
        return f"fleet {t.name} of {t.workers.count}\n"

    def name_of(self, t) -> str:
        return f"fleet-{t.name}"

    def checks(self):
        return [lambda t, f: Check("fleet", True, f"{f.target['ships']} ships")]

    def gather_facts(self, t, client, facts: Facts, probe: bool) -> dict[str, Any]:
        return {"target": {"ships": t.workers.count}}

    def deploy(self, c, env, out) -> list[str]:
        self.calls.append(("deploy", dict(env)))
        self.ships = {s.name: ServiceState(s.name, "running", spec=s) for s in services(c.topology)}
        self.looks = 0
        return []

    def describe(self, c) -> list[ServiceState]:
        self.looks += 1
        if self.looks > 2:
            self.ships = {n: replace(s, status="exited", exit_code=0) for n, s in self.ships.items()}
        return list(self.ships.values())

    def log_iter(self, c, follow: bool, options=None):
        return ReadLines(f"{n} | at sea\n" for n in self.ships)

    def remove(self, c, volumes: bool) -> None:
        self.calls.append(("remove", volumes))
        self.ships = {}

    def read_records(self, c, service: str) -> dict[str, list[str]]:
        return {"ps.jsonl": end_records(len(self.ships) - 1)}

    def scale_to(self, c, start, stop, env) -> None:
        self.calls.append(("scale", (list(start), list(stop))))
        for name in stop:
            self.ships[name] = replace(self.ships[name], status="exited", exit_code=0)


def test_a_new_target_is_its_blocks_and_one_registry_line(cli, monkeypatch, tmp_path: Path) -> None:  # noqa: F811
    fake = FakeBackend()
    monkeypatch.setitem(registry.BACKENDS, "fake", fake)
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    status, out, err = cli("render", "-c", str(SMOKE), "--target", "fake", "--workers", "4")
    assert status == 0, err
    assert (tmp_path / "fake.txt").read_text() == "fleet cpu-smoke of 4\n" and "fleet fleet-cpu-smoke" in out
    status, out, _ = cli("doctor", "-c", str(SMOKE), "--target", "fake")
    assert status == 0 and "ok       fleet         2 ships" in out and "doctor: all 1 checks passed" in out

    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(SMOKE.read_text().replace("  count: 2", "  count: 2\n  max: 4"))
    status, out, err = cli("fake-up", "-c", str(scaled), "--workers", "3", "--resume")
    assert status == 0, err
    assert "==> doctor: 1 checks passed (python -m orchestrator doctor --target fake lists them)" in out
    assert "run " in out and fake.calls[-1][0] == "deploy" and fake.calls[-1][1]["PSC_RESUME"] == "true"
    assert (
        out.splitlines()[-1]
        == "==> up: fleet fleet-cpu-smoke. Next: make fake-logs | make fake-status | make fake-down"
    )
    assert (tmp_path / "runs" / "fleet-cpu-smoke" / "fake.txt").read_text() == "fleet cpu-smoke of 3\n"

    status, out, _ = cli("fake-status")  # the last fake-up's fleet, from the record
    assert status == 0 and out.splitlines()[0].startswith("fleet fleet-cpu-smoke (")
    assert [line.split()[:2] for line in out.splitlines()[2:6]] == [
        ["ps", "running"],
        ["worker1", "running"],
        ["worker2", "running"],
        ["worker3", "running"],
    ]
    assert out.splitlines()[-2:] == [
        "live workers: 0 (the run ended at version 300)",  # the PS's `end` record is its newest
        "progress: ended at step 300",
    ]
    status, out, err = cli("fake-scale", "--workers", "2")
    assert status == 0, err
    assert fake.calls[-1] == ("scale", ([], ["worker3"])) and "(stopped worker3)" in out
    status, out, _ = cli("fake-logs")  # follows until every ship is home, then the run's report from its records
    *lines, said = out.splitlines()
    assert status == 0 and lines == [f"{n} | at sea" for n in ("ps", "worker1", "worker2", "worker3")]
    report = tmp_path / "runs" / "fleet-cpu-smoke" / "report"
    assert said == f"==> report: loss.png, accuracy.png, throughput.png, summary.txt in {report}/"
    assert (report / "accuracy.png").stat().st_size > 0
    status, out, err = cli("fake-tensorboard")
    assert status == 2 and err == "error: target fake has no tensorboard verb: render it and use its own tools\n"
    status, out, _ = cli("fake-down", "-v")
    assert status == 0 and out == "==> down: fleet fleet-cpu-smoke stopped and removed; volume removed\n"

    status, out, err = cli("fake-smoke", "-c", str(SMOKE), "--timeout", "60")
    assert status == 0, out + err
    assert "fake-smoke: passed: Accuracy 0.9500 >= 0.90; 3 ships home (ps, worker1, worker2)" in out
    assert fake.calls[-1] == ("remove", True) and not fake.ships


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
    from orchestrator.errors import UsageError
    from orchestrator.verbs import scaling

    config = tmp_path / "t.yaml"
    config.write_text(
        Path(SMOKE).read_text().replace("strategy: async", "strategy: allreduce").replace("name: cpu-smoke", "name: t")
    )
    with pytest.raises(UsageError, match="strategy allreduce has a fixed world size; .* RESUME=1") as e:
        scaling.scale(registry.get("compose"), str(config), 3)
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="stack-scale: a running stack is not scaled yet") as e:
        scaling.scale(registry.get("swarm"), None, 3)
    assert "\n" not in str(e.value)


def _follow_to_the_end(fleet: FakeBackend, monkeypatch, printed: Path) -> tuple[bool, str]:
    """`logs` on a fleet whose every ship has exited 0 once the follow has `printed` its line (a
    loaded host takes more than the three looks' 0.6 s to start a Python), in a thread: (it
    returned within 30 s, what it wrote)."""
    import threading

    from orchestrator.verbs import cluster as verbs

    ended = [ServiceState("ps", "exited", exit_code=0), ServiceState("worker1", "exited", exit_code=0)]
    running = [replace(s, status="running", exit_code=None) for s in ended]
    look = fleet.describe

    def describe(c):
        look(c)  # the fleet's own look: counted, and it may fail
        return ended if printed.exists() else running

    monkeypatch.setattr(fleet, "describe", describe)
    monkeypatch.setattr(verbs, "POLL", 0.2)
    out = io.StringIO()
    done = threading.Event()
    threading.Thread(target=lambda: (verbs.logs(fleet, str(SMOKE), name="f", out=out), done.set()), daemon=True).start()
    return done.wait(30), out.getvalue()


def _following_for_ever(line: str, printed: Path):
    """A log follow that never ends by itself: `line` (then the file `printed` made), then nothing
    for 10 minutes."""
    import sys

    from orchestrator.backends.lines import ProcessLines

    code = f"import time; print({line!r}, flush=True); open({str(printed)!r}, 'w').close(); time.sleep(600)"
    return ProcessLines([[sys.executable, "-c", code]])


def test_logs_stops_following_once_every_service_has_ended(monkeypatch, tmp_path: Path) -> None:
    """A follow that never ends by itself (as `compose logs -f` with the scale profile did after
    a scaled run) is closed once every service has ended, on two looks in a row."""

    printed = tmp_path / "printed"

    class Following(FakeBackend):
        def log_iter(self, c, follow: bool, options=None):
            return _following_for_ever("ps | Accuracy: 0.97", printed)

    returned, out = _follow_to_the_end(Following(), monkeypatch, printed)
    assert returned, "logs still follows a cluster whose every service has ended"
    assert out == "ps | Accuracy: 0.97\n"


def test_logs_stops_following_after_a_look_the_engine_did_not_answer(monkeypatch, tmp_path: Path) -> None:
    """A look at the cluster that fails (a container removed between the engine's listing and
    its inspect) does not end the watch: the next looks still close the follow."""
    import docker.errors

    printed = tmp_path / "printed"

    class Unsteady(FakeBackend):
        failed = False

        def log_iter(self, c, follow: bool, options=None):
            return _following_for_ever("ps | up", printed)

        def describe(self, c):
            if not self.failed:
                self.failed = True
                raise docker.errors.NotFound("No such container: f-worker3")
            return super().describe(c)

    fleet = Unsteady()
    returned, out = _follow_to_the_end(fleet, monkeypatch, printed)
    assert returned, "logs follows for ever once one look at the cluster failed"
    assert fleet.failed and fleet.looks >= 2 and out == "ps | up\n"


class ResumableFleet(FakeBackend):
    """A fleet whose state holds one stopped run (r-a, at step 3) and one finished (r-b)."""

    def read_records(self, c, service: str) -> dict[str, list[str]]:
        lines = [
            {"event": "start", "run_id": "r-a", "time": 1, "step": 0},
            {"event": "eval", "step": 3, "accuracy": 0.5, "time": 2},
            {"event": "start", "run_id": "r-b", "time": 3, "step": 0},
            {"event": "end", "step": 9, "accuracy": 0.9, "time": 4},
        ]
        return {"ps.jsonl": [json.dumps(r) for r in lines]}


def test_up_resume_of_a_run_id_deploys_that_run_and_refuses_one_the_state_does_not_hold(
    cli,  # noqa: F811
    monkeypatch,
    tmp_path: Path,
) -> None:
    """`up --resume RUN_ID` on a target: the run ids are read from the PS's metrics in the state
    (as `runs` lists them): a stopped one is deployed under its own id, resuming; an unknown or a
    finished one is one line, exit 2, nothing deployed."""
    fake = ResumableFleet()
    monkeypatch.setitem(registry.BACKENDS, "fake", fake)
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    status, out, err = cli("fake-up", "-c", str(SMOKE), "--resume", "r-a")
    assert status == 0, err
    assert fake.calls[-1] == ("deploy", {"PSC_RUN_ID": "r-a", "PSC_RESUME": "true"})
    assert "run r-a again (--resume r-a)" in out
    fake.ships, fake.calls = {}, []
    for run, said in [("nope", "has no run of that id (its runs: r-a, r-b)"), ("r-b", "finished at step 9")]:
        status, out, err = cli("fake-up", "-c", str(SMOKE), "--resume", run)
        assert status == 2 and len(err.splitlines()) == 1 and said in err, err
        assert not fake.calls
