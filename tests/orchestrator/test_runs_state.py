"""Runs and the PS's state: each up/stack-up/local is a run with its own id (interpolated
by compose and docker stack deploy, so the rendered files stay the same), --resume, the state
volume's driver, and where the PS goes on a swarm of several nodes (and what doctor says)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from orchestrator import runs
from orchestrator.backends import command
from orchestrator.backends.base import ServiceState
from orchestrator.backends.compose import adapter as compose_adapter
from orchestrator.backends.swarm import adapter as swarm_adapter
from orchestrator.render import compose as render_compose
from orchestrator.render import swarm as render_swarm
from orchestrator.topology.model import Topology, parse

import doctor_kit as d
from orch_helpers import REPO, topology, training

CPU = (REPO / "configs/cpu-smoke.yaml").read_text()
SPREAD = "swarm: {workers: [node-a, node-b]}\n"
NFS = 'state: {volume_driver: local, driver_opts: {type: nfs, o: "addr=10.0.0.5,rw", device: ":/exports/psc"}}\n'
NODE = {"hostname": "a", "role": "manager", "availability": "active", "state": "ready", "labels": {}, "resources": {}}
WORKER = {**NODE, "hostname": "b", "role": "worker"}


def topo(extra: str = "", text: str = CPU) -> Topology:
    return parse(text + extra, "t.yaml")


def sharded(t: Topology, shards: int = 2) -> Topology:
    return t.model_copy(update={"ps": dataclasses.replace(t.ps, shards=shards)})


def placements(t: Topology, nodes: int = 0) -> dict[str, list[str] | None]:
    doc = render_swarm.render(t, data_root="/srv", nodes=nodes)
    return {name: (svc["deploy"].get("placement") or {}).get("constraints") for name, svc in training(doc).items()}


# --- run ids ----------------------------------------------------------------


def test_a_new_run_id_is_sortable_unique_and_a_valid_app_run_id():
    ids = {runs.new_id(0) for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"19700101-000000-[0-9a-f]{6}", i) for i in ids)
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", runs.new_id())  # app.config.RUN_ID


def test_every_rendered_service_reads_the_run_from_the_callers_environment():
    for t in (topo(), sharded(topo()), topo(text=CPU.replace("strategy: async", "strategy: allreduce"))):
        for svc in training(render_compose.render(t)).values():
            assert svc["environment"]["PSC_RUN_ID"] == "${PSC_RUN_ID:-}"
            assert svc["environment"]["PSC_RESUME"] == "${PSC_RESUME:-}"


def test_up_keeps_the_run_that_still_goes_on_else_starts_a_new_one():
    env, line = runs.start({}, resume=False)
    assert env["PSC_RESUME"] == "false" and line.startswith(f"run {env['PSC_RUN_ID']}: starts fresh at version 0")
    env, line = runs.start({}, resume=True)
    assert env["PSC_RESUME"] == "true" and "--resume: the PS continues the newest" in line
    env, line = runs.start({}, resume="r-7")  # --resume RUN_ID: that run again, under its own id
    assert env == {"PSC_RUN_ID": "r-7", "PSC_RESUME": "true"} and line.startswith("run r-7 again (--resume r-7)")
    going = {"PSC_RUN_ID": "r-1", "PSC_RESUME": "false"}
    assert runs.start(going, resume=True) == (
        going,
        "run r-1 (still running: its id is kept, so its PS resumes its own checkpoints)",
    )


def _container(status: str, env: list[str]) -> SimpleNamespace:
    return SimpleNamespace(attrs={"State": {"Status": status}, "Config": {"Env": env}})


def test_the_run_of_a_running_project_is_read_from_its_containers(monkeypatch):
    found = [
        _container("exited", ["PSC_RUN_ID=old", "PSC_RESUME=false"]),
        _container("running", ["PATH=/bin", "PSC_RUN_ID=r-2", "PSC_RESUME=true"]),
    ]
    monkeypatch.setattr(compose_adapter, "containers", lambda client, project: found)
    assert compose_adapter.running_env(None, "p", runs.VARIABLES) == {"PSC_RUN_ID": "r-2", "PSC_RESUME": "true"}
    monkeypatch.setattr(compose_adapter, "containers", lambda client, project: found[:1])
    assert compose_adapter.running_env(None, "p", runs.VARIABLES) == {}


def test_the_run_of_a_stack_is_read_from_its_services_while_a_task_runs(monkeypatch):
    spec = {"Spec": {"TaskTemplate": {"ContainerSpec": {"Env": ["PSC_RUN_ID=r-3", "PSC_RESUME=false"]}}}}
    monkeypatch.setattr(swarm_adapter, "services", lambda client, stack: {"ps": SimpleNamespace(attrs=spec)})
    monkeypatch.setattr(swarm_adapter, "states", lambda client, stack: {"ps": ServiceState("ps", "running")})
    assert swarm_adapter.running_env(None, "s", runs.VARIABLES) == {"PSC_RUN_ID": "r-3", "PSC_RESUME": "false"}
    monkeypatch.setattr(swarm_adapter, "states", lambda client, stack: {"ps": ServiceState("ps", "exited")})
    assert swarm_adapter.running_env(None, "s", runs.VARIABLES) == {}


def test_the_compose_command_gets_the_run_in_its_environment(tmp_path):
    probe = [sys.executable, "-c", "import os; print(os.environ['PSC_RUN_ID'], os.environ['PATH'] != '')"]
    r = command.run(probe, capture=True, env=runs.environment("r-9", False))
    assert r.stdout.split() == ["r-9", "True"]


FAKE_APP = """
import json, os, sys
name = "ps" if sys.argv[1] == "ps" else "worker" + os.environ["PSC_RANK"]
open(f"{name}.json", "w").write(json.dumps({k: v for k, v in os.environ.items() if k.startswith("PSC_")}))
"""


@pytest.mark.parametrize("resume", [False, True])
def test_local_gives_every_process_one_new_run_and_the_resume_flag(tmp_path, resume):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "__main__.py").write_text(FAKE_APP)
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topology()))
    p = subprocess.run(
        [sys.executable, "-m", "orchestrator", "local", "-c", "topo.yaml", *(["--resume"] if resume else [])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert p.returncode == 0, p.stderr
    seen = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ps", "worker1", "worker2")]
    assert len({s["PSC_RUN_ID"] for s in seen}) == 1 and seen[0]["PSC_RUN_ID"]
    assert {s["PSC_RESUME"] for s in seen} == {"true" if resume else "false"}
    assert f"local: run {seen[0]['PSC_RUN_ID']}: " in p.stdout


def _local(where, *args):
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "local", "-c", "topo.yaml", *args],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )


def test_local_resume_of_a_run_id_gives_every_process_that_id_and_refuses_one_it_does_not_know(tmp_path):
    """`local --resume RUN_ID` (`make local RESUME=RUN_ID`): the run's processes take that id, and
    the PS continues it (app.checkpoint.resume); an id the name never ran, or a run that finished,
    is one line, exit 2, nothing started."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "__main__.py").write_text(FAKE_APP)
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topology()))
    metrics = tmp_path / "runs" / "t" / "metrics"
    metrics.mkdir(parents=True)
    records = [
        {"event": "start", "run_id": "r-a", "time": 1.0, "step": 0},
        {"event": "eval", "step": 3, "accuracy": 0.5, "time": 2.0},
        {"event": "start", "run_id": "r-b", "time": 3.0, "step": 0},
        {"event": "end", "step": 9, "accuracy": 0.9, "time": 4.0},
    ]
    (metrics / "ps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    p = _local(tmp_path, "--resume", "r-a")
    assert p.returncode == 0, p.stderr
    seen = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ps", "worker1", "worker2")]
    assert {(s["PSC_RUN_ID"], s["PSC_RESUME"]) for s in seen} == {("r-a", "true")}
    assert "local: run r-a again (--resume r-a)" in p.stdout
    for args, said in [
        (["--resume", "nope"], "--resume: got 'nope'; t (local) has no run of that id (its runs: r-a, r-b)"),
        (["--resume", "r-b"], "--resume: got 'r-b'; that run of t finished at step 9: nothing to resume"),
        (["--resume", "train.lr=0.1"], "got 'train.lr=0.1', an override: give it before --resume"),
    ]:
        (tmp_path / "ps.json").unlink(missing_ok=True)
        p = _local(tmp_path, *args)
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1 and said in p.stderr, p.stderr
        assert not (tmp_path / "ps.json").exists()


# --- the state volume --------------------------------------------------------


def test_the_state_volume_takes_the_driver_and_its_options_in_compose_and_swarm():
    t = topo(NFS)
    expected = {
        "driver": "local",
        "driver_opts": {"type": "nfs", "o": "addr=10.0.0.5,rw", "device": ":/exports/psc"},
        "labels": {"ps-compose.project": "cpu-smoke"},
    }
    assert render_compose.render(t)["volumes"]["state"] == expected
    assert render_swarm.render(t, data_root="/srv")["volumes"] == {"state": expected}
    assert render_compose.render(topo())["volumes"]["state"] == {"labels": {"ps-compose.project": "cpu-smoke"}}


@pytest.mark.parametrize(
    "state,shared",
    [
        ({}, False),
        ({"volume_driver": "local"}, False),
        ({"volume_driver": "local", "driver_opts": {"type": "tmpfs", "device": "tmpfs"}}, False),
        ({"volume_driver": "local", "driver_opts": {"type": "nfs4", "o": "addr=h", "device": ":/x"}}, True),
        ({"volume_driver": "vieux/sshfs", "driver_opts": {"sshcmd": "u@h:/x"}}, True),
    ],
)
def test_which_volumes_are_shared(state, shared):
    assert parse(yaml.safe_dump(topology(state=state)), "t.yaml").state.shared is shared


@pytest.mark.parametrize(
    "state,expected",
    [
        (
            {"driver_opts": {"type": "nfs"}},
            "state.driver_opts: got {'type': 'nfs'}; allowed only with "
            "state.volume_driver (e.g. local, with type: nfs)",
        ),
        ({"volume_driver": "Not A Driver"}, "state.volume_driver: got 'Not A Driver'; must be a volume driver name"),
        ({"volume_driver": "local", "driver_opts": {"o": 4}}, "state.driver_opts.o: got 4; must be a valid string"),
        (
            {"volume_driver": "local", "driver_opts": {"bad key": "x"}},
            "state.driver_opts: got {'bad key': 'x'}; option name 'bad key' must be",
        ),
        (
            {"volume_driver": "local", "driver_opts": {"type": "nfs", "device": ":/x"}},
            "state.driver_opts: got {'type': 'nfs', 'device': ':/x'}; type nfs needs device (the export, e.g. "
            "':/exports/psc') and o with addr=SERVER",
        ),
        ({"size": 3}, "state.size: unknown key; allowed: volume_driver, driver_opts"),
    ],
)
def test_a_bad_state_section_is_one_line_exit_2(cli, write_config, state, expected):
    status, out, err = cli("render", "-c", str(write_config(topology(state=state))), "-o", "-")
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and expected in err, err


# --- where the PS goes on a swarm ----------------------------------------------


def test_on_one_node_or_unknown_nothing_is_pinned():
    assert set(placements(topo()).values()) == {None}
    assert set(placements(topo(), nodes=1).values()) == {None}


def test_on_several_nodes_the_ps_is_pinned_to_the_manager():
    assert placements(topo(SPREAD)) == {
        "ps": ["node.role==manager"],
        "worker1": ["node.hostname==node-a"],
        "worker2": ["node.hostname==node-b"],
    }
    assert placements(topo(), nodes=2) == {"ps": ["node.role==manager"], "worker1": None, "worker2": None}


def test_shards_and_the_allreduce_rank_0_are_pinned_too():
    split = placements(sharded(topo()), nodes=3)
    assert split == {
        "ps": ["node.role==manager"],
        "ps-shard1": ["node.role==manager"],
        "worker1": None,
        "worker2": None,
    }
    ddp = placements(topo(text=CPU.replace("strategy: async", "strategy: allreduce")), nodes=2)
    assert ddp == {"worker1": ["node.role==manager"], "worker2": None}


def test_an_own_placement_or_a_shared_volume_is_never_overridden():
    assert placements(topo("swarm: {ps: node-b, workers: [node-a]}\n"))["ps"] == ["node.hostname==node-b"]
    assert placements(topo(SPREAD + NFS), nodes=2)["ps"] is None
    assert placements(topo("state: {volume_driver: local}\n"), nodes=2)["ps"] == ["node.role==manager"]


def _state(t: Topology, nodes: list[dict]) -> d.Check:
    return d.check_state(t, "swarm", d.Facts(nodes=nodes))


def test_doctor_says_why_the_ps_is_pinned_in_one_line():
    c = _state(topo(), [NODE, WORKER])
    assert c.ok and "\n" not in c.text
    assert c.text.startswith("the PS is pinned to the manager (node.role==manager): volume cpu-smoke_state is local")
    assert "managers" not in c.text
    assert "2 managers: set swarm.ps" in _state(topo(), [NODE, {**WORKER, "role": "manager"}]).text
    assert _state(topo(), [NODE]).text == "one node: the PS's checkpoints stay in its volume cpu-smoke_state"
    assert "on driver local (shared)" in _state(topo(NFS), [NODE, WORKER]).text
    assert "swarm.ps node-b" in _state(topo("swarm: {ps: node-b}\n"), [NODE, WORKER]).text


def test_doctor_reports_a_pinned_ps_with_no_manager_to_run_on():
    c = _state(topo(), [{**NODE, "availability": "drain"}, WORKER])
    assert c.ok is False and "no manager is ready and active" in c.text and "--availability active" in c.fix
    assert d.find("state", "swarm").__module__ == "orchestrator.backends.swarm.doctor"
