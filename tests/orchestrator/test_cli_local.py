"""`orchestrator local`: the env mapping (shared with the render) and the process handling."""

from __future__ import annotations

import dataclasses
import io
import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.render import compose as render_compose
from orchestrator.topology.fields import Tracking
from orchestrator.topology.model import load
from orchestrator.topology.services import service_names
from orchestrator.verbs import local
from orchestrator.verbs.local import RESTARTS, ProcessSpec, Supervisor, local_environment, plan

from needs import host_has
from orch_helpers import REPO, topology

# What differs between a container and a local process; everything else is equal. The run's
# variables: values for a local run, `${PSC_RUN_ID:-}` in the compose file (orchestrator.runs);
# MLflow's, from the caller's environment.
HOST_SPECIFIC = {
    "PSC_MASTER_ADDR",
    "PSC_MASTER_PORT",
    "PSC_DATA_DIR",
    "PSC_CHECKPOINT_DIR",
    "PSC_METRICS_DIR",
    "PSC_CACHE_DIR",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "PSC_SECRET_FILE",
    "PSC_SOCKET_DIR",
    "PSC_RUN_ID",
    "PSC_RESUME",
    "MLFLOW_TRACKING_URI",  # the caller's, interpolated by compose; a local process is given its value
    "MLFLOW_EXPERIMENT_NAME",
}


@pytest.mark.parametrize("config", ["configs/default.yaml", "configs/cpu-smoke.yaml"])
def test_local_env_equals_render_env_but_address_and_paths(config: str, tmp_path: Path) -> None:
    t = load(REPO / config).with_workers(4)
    services = render_compose.render(t)["services"]
    for rank, name in enumerate(service_names(t)):
        # Names only (credentials): compose takes them from its caller, as a local process inherits them.
        container = {k: v for k, v in services[name]["environment"].items() if v is not None}
        # For the nvidia runtime only; locally, CUDA_VISIBLE_DEVICES="" hides the GPUs.
        void = container.pop("NVIDIA_VISIBLE_DEVICES", None)
        assert void == ("void" if t.cuda and rank == 0 else None)
        # A container's restart says a mistake again (app/stops.py); a local process that exits 2
        # is not restarted, so it keeps nothing.
        assert container.pop("PSC_STOP_FILE") == "/tmp/psc-stopped"
        exchange = {"PSC_SECRET_FILE": "/run/secret", "PSC_SOCKET_DIR": "/run/sockets"}
        local = local_environment(t, rank, port=4321, run_dir=tmp_path / "run", ifname="lo", exchange=exchange)
        cuda = local.pop("CUDA_VISIBLE_DEVICES", None)
        assert set(local) == set(container)
        assert {k: v for k, v in local.items() if k not in HOST_SPECIFIC} == {
            k: v for k, v in container.items() if k not in HOST_SPECIFIC
        }
        assert local["PSC_MASTER_ADDR"] == "127.0.0.1" and local["PSC_MASTER_PORT"] == "4321"
        assert local["PSC_CHECKPOINT_DIR"] == str(tmp_path / "run" / "checkpoints")
        assert local["PSC_METRICS_DIR"] == str(tmp_path / "run" / "metrics")
        assert local["GLOO_SOCKET_IFNAME"] == "lo"
        assert local.get("NCCL_SOCKET_IFNAME") == ("lo" if t.cuda else None)
        if t.reads_files:
            assert local["PSC_DATA_DIR"] == str((Path.cwd() / t.train.data_dir).resolve())
        if t.cuda:  # the worker sees its own GPU as cuda:0; the PS none (it runs on CPU)
            assert cuda == ("" if rank == 0 else str(rank - 1))
        else:
            assert cuda is None


def test_plan_runs_python_m_app(tmp_path: Path) -> None:
    t = load(REPO / "configs/cpu-smoke.yaml")
    specs = plan(t, port=1, run_dir=tmp_path, ifname="lo", python="/py")
    assert [(s.name, s.argv) for s in specs] == [
        ("ps", ["/py", "-m", "app", "ps"]),
        ("worker1", ["/py", "-m", "app", "worker"]),
        ("worker2", ["/py", "-m", "app", "worker"]),
    ]


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_supervisor_prefixes_output_and_succeeds() -> None:
    out = io.StringIO()
    specs = [
        ProcessSpec("ps", _py("print('a'); print('b')"), {}),
        ProcessSpec("worker1", _py("import os; print(os.environ['X'])"), {"X": "hello"}),
    ]
    assert Supervisor(specs, out=out).run() == 0
    lines = out.getvalue().splitlines()
    assert "ps      | a" in lines and "ps      | b" in lines and "worker1 | hello" in lines
    assert "worker1 | exited with code 0" in lines
    assert lines.index("ps      | a") < lines.index("ps      | b")


def test_supervisor_stops_the_rest_when_one_fails() -> None:
    out = io.StringIO()
    # The PS would sleep far past the test's timeout: it ends only because the
    # supervisor stops it (SIGTERM, code -15) once worker1 has failed.
    specs = [
        ProcessSpec("ps", _py("import time; time.sleep(3600)"), {}),
        ProcessSpec("worker1", _py("raise SystemExit(3)"), {}),
    ]
    assert Supervisor(specs, out=out).run() == 1
    assert "worker1 | exited with code 3" in out.getvalue()
    assert re.search(r"ps +\| stopped \(code -15\)", out.getvalue())
    assert out.getvalue().index("worker1 | exited with code 3") < out.getvalue().index("stopped (code -15)")


def test_supervisor_keep_going_waits_for_all() -> None:
    out = io.StringIO()
    specs = [
        ProcessSpec("ps", _py("import time; time.sleep(1); print('done')"), {}),
        ProcessSpec("worker1", _py("raise SystemExit(1)"), {}),
    ]
    assert Supervisor(specs, out=out, keep_going=True).run() == 1
    assert "ps      | done" in out.getvalue()


def test_supervisor_restarts_a_failed_worker_which_then_succeeds(tmp_path: Path) -> None:
    # worker1 fails on its first start (the marker file is not there yet) and succeeds on
    # its second; the PS waits for the marker worker1's second start leaves.
    marker, done = tmp_path / "started-once", tmp_path / "worker1-done"
    worker = (
        f"import pathlib, sys; m = pathlib.Path({str(marker)!r})\n"
        f"if not m.exists(): m.touch(); sys.exit(1)\n"
        f"pathlib.Path({str(done)!r}).touch(); print('second start')"
    )
    ps = f"import pathlib, time\nwhile not pathlib.Path({str(done)!r}).exists(): time.sleep(0.05)\nprint('done')"
    out = io.StringIO()
    specs = [ProcessSpec("ps", _py(ps), {}), ProcessSpec("worker1", _py(worker), {}, restarts=2)]
    assert Supervisor(specs, out=out, restart_delay=0).run() == 0, out.getvalue()
    lines = out.getvalue().splitlines()
    assert "worker1 | exited with code 1; restarting (1 of 2)" in lines
    assert "worker1 | second start" in lines and "worker1 | exited with code 0" in lines
    assert "ps      | done" in lines and "ps      | exited with code 0" in lines


def test_supervisor_stops_the_rest_when_a_worker_is_out_of_restarts() -> None:
    out = io.StringIO()
    specs = [
        ProcessSpec("ps", _py("import time; time.sleep(3600)"), {}),
        ProcessSpec("worker1", _py("raise SystemExit(3)"), {}, restarts=2),
    ]
    assert Supervisor(specs, out=out, restart_delay=0).run() == 1
    lines = out.getvalue().splitlines()
    assert [line for line in lines if line.startswith("worker1")] == [
        "worker1 | exited with code 3; restarting (1 of 2)",
        "worker1 | exited with code 3; restarting (2 of 2)",
        "worker1 | exited with code 3",
    ]
    assert re.search(r"ps +\| stopped \(code -15\)", out.getvalue())


def test_supervisor_does_not_restart_bad_input() -> None:
    out = io.StringIO()
    specs = [
        ProcessSpec("ps", _py("import time; time.sleep(3600)"), {}),
        ProcessSpec("worker1", _py("raise SystemExit(2)"), {}, restarts=3),
    ]
    assert Supervisor(specs, out=out, restart_delay=0).run() == 2
    assert "restarting" not in out.getvalue() and "worker1 | exited with code 2" in out.getvalue()


def test_supervisor_does_not_restart_a_worker_once_the_ps_has_ended(tmp_path: Path) -> None:
    # The PS ends (0) first; worker1 fails after it: there is nothing to rejoin.
    ps_done = tmp_path / "ps-done"
    worker = (
        f"import pathlib, sys, time\nwhile not pathlib.Path({str(ps_done)!r}).exists(): time.sleep(0.05)\n"
        "time.sleep(0.5); sys.exit(1)"
    )  # the PS exits right after writing the file
    out = io.StringIO()
    specs = [
        ProcessSpec("ps", _py(f"import pathlib; pathlib.Path({str(ps_done)!r}).touch()"), {}, anchor=True),
        ProcessSpec("worker1", _py(worker), {}, restarts=3),
    ]
    assert Supervisor(specs, out=out, restart_delay=0).run() == 1
    assert "restarting" not in out.getvalue() and "worker1 | exited with code 1" in out.getvalue()


def test_supervisor_starts_a_failed_ps_again_and_its_workers_rejoin_it(tmp_path: Path) -> None:
    """As compose's `restart: on-failure`: the PS's first start fails, and worker1 with it (it
    lost its PS); both are started again, and the run ends 0. The state file follows it."""
    ps_marker, worker_marker = tmp_path / "ps-started-once", tmp_path / "worker-started-once"
    ps_up, worker_done = tmp_path / "ps-up", tmp_path / "worker-done"
    ps = (
        f"import pathlib, sys, time; m = pathlib.Path({str(ps_marker)!r})\n"
        f"if not m.exists(): m.touch(); sys.exit(1)\n"
        f"pathlib.Path({str(ps_up)!r}).touch()\n"
        f"while not pathlib.Path({str(worker_done)!r}).exists(): time.sleep(0.05)"
    )
    worker = (  # its first start fails (it lost its PS); the next trains once the PS is back
        f"import pathlib, sys, time; m = pathlib.Path({str(worker_marker)!r})\n"
        f"if not m.exists(): m.touch(); sys.exit(1)\n"
        f"while not pathlib.Path({str(ps_up)!r}).exists(): time.sleep(0.05)\n"
        f"pathlib.Path({str(worker_done)!r}).touch()"
    )
    out = io.StringIO()
    specs = [
        ProcessSpec("ps", _py(ps), {}, restarts=2, anchor=True),
        ProcessSpec("worker1", _py(worker), {}, restarts=2),
    ]
    assert Supervisor(specs, out=out, restart_delay=0.2, state_dir=tmp_path).run() == 0, out.getvalue()
    lines = out.getvalue().splitlines()
    assert "ps      | exited with code 1; restarting (1 of 2)" in lines
    assert "ps      | exited with code 0" in lines and "worker1 | exited with code 0" in lines
    state = json.loads((tmp_path / "local-state.json").read_text())
    assert state["launcher"] == os.getpid()
    assert state["services"]["ps"]["status"] == "exited" and state["services"]["ps"]["exit_code"] == 0
    assert state["services"]["ps"]["restarts"] == 1
    assert state["services"]["worker1"]["status"] == "exited" and state["services"]["worker1"]["restarts"] == 1
    assert (tmp_path / "local-state.json").stat().st_mode & 0o077 == 0


def test_supervisor_stops_every_process_when_the_ps_is_out_of_restarts() -> None:
    out = io.StringIO()
    specs = [
        ProcessSpec("ps", _py("raise SystemExit(3)"), {}, restarts=1, anchor=True),
        ProcessSpec("worker1", _py("import time; time.sleep(3600)"), {}, restarts=3),
    ]
    assert Supervisor(specs, out=out, restart_delay=0).run() == 1
    lines = out.getvalue().splitlines()
    assert "ps      | exited with code 3; restarting (1 of 1)" in lines and "ps      | exited with code 3" in lines
    assert any(line.startswith("worker1 | stopped (code") for line in lines), lines


def test_plan_restarts_every_process_of_a_ps_job_and_none_under_allreduce(tmp_path: Path) -> None:
    t = load(REPO / "configs/cpu-smoke.yaml")
    assert [(s.name, s.restarts, s.anchor) for s in plan(t, port=1, run_dir=tmp_path, ifname="lo")] == [
        ("ps", RESTARTS, True),
        ("worker1", RESTARTS, False),
        ("worker2", RESTARTS, False),
    ]
    allreduce = t.model_copy(update={"train": dataclasses.replace(t.train, strategy="allreduce")})
    assert [(s.name, s.restarts) for s in plan(allreduce, port=1, run_dir=tmp_path, ifname="lo")] == [
        ("worker1", 0),
        ("worker2", 0),
    ]


def test_supervisor_passes_on_bad_input_status() -> None:
    specs = [ProcessSpec("ps", _py("raise SystemExit(2)"), {})]
    assert Supervisor(specs, out=io.StringIO()).run() == 2


FAKE_APP = """
import json, os, sys, time
role = sys.argv[1]
name = "ps" if role == "ps" else "worker" + os.environ["PSC_RANK"]
env = {k: v for k, v in os.environ.items() if k.startswith(("PSC_", "TP_"))}
if os.environ.get("FAKE_IGNORE_TERM"):  # a process that outlives its launcher's death (before it says it started)
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# Its one line first: once its file is there it writes nothing more, so a test may kill the
# launcher that reads its output then (a line written after that would end it on EPIPE).
print(f"{name} started", flush=True)
# whole or not there: the tests wait for the file to exist, then read it
open(f"{name}.json.tmp", "w").write(json.dumps({"argv": sys.argv[1:], "env": env, "pid": os.getpid()}))
os.replace(f"{name}.json.tmp", f"{name}.json")
if os.environ.get("FAKE_SLEEP"):
    time.sleep(120)
"""


@pytest.fixture
def fake_app(tmp_path: Path) -> Path:
    """A directory with a stand-in `app` package; `python -m app` there runs it."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "__main__.py").write_text(FAKE_APP)
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topology()))
    return tmp_path


def _orchestrator(cwd: Path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_local_runs_every_rank_with_its_env(fake_app: Path) -> None:
    p = _orchestrator(fake_app, "local", "-c", "topo.yaml", "--workers", "3")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    for name in ("ps", "worker1", "worker2", "worker3"):
        assert re.search(rf"^{name} +\| {name} started$", out, re.M), out
        seen = json.loads((fake_app / f"{name}.json").read_text())
        assert seen["argv"] == (["ps"] if name == "ps" else ["worker"])
        assert seen["env"]["PSC_WORLD_SIZE"] == "4"
        assert seen["env"]["PSC_METRICS_DIR"] == str(fake_app / "runs" / "t" / "metrics")
    assert (fake_app / "runs" / "t" / "checkpoints").is_dir()


def test_a_local_run_remembers_its_topology_and_a_verb_on_its_name_alone_reads_it(fake_app: Path, monkeypatch) -> None:
    """`export --local --name X` and `tensorboard --local --name X` without -c act on the
    topology X's last local run was started from, its overrides too."""
    p = _orchestrator(fake_app, "local", "-c", "topo.yaml", "--name", "mine", "train.lr=0.07")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    record = json.loads((fake_app / "runs" / "mine" / "local.json").read_text())
    assert record == {"name": "mine", "config": str(fake_app / "topo.yaml"), "overrides": ["train.lr=0.07"]}
    monkeypatch.chdir(fake_app)
    t = local.topology_of(None, name="mine")
    assert t.name == "mine" and t.train.lr == 0.07 and t.overrides == ("train.lr=0.07",)
    fallback = local.topology_of(None, name="never-run")  # no local run of that name: the default topology
    assert fallback.name == "never-run" and fallback.train.model == load(REPO / "configs" / "default.yaml").train.model


def test_local_needs_no_image_section(fake_app: Path) -> None:
    doc = topology()
    del doc["image"]
    (fake_app / "bare.yaml").write_text(yaml.safe_dump(doc))
    p = _orchestrator(fake_app, "local", "-c", "bare.yaml")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert json.loads((fake_app / "worker1.json").read_text())["env"]["PSC_DEVICE"] == "cpu"


def test_local_sigterm_stops_every_process(fake_app: Path) -> None:
    p = _orchestrator(fake_app, "local", "-c", "topo.yaml", FAKE_SLEEP="1")
    names = ("ps", "worker1", "worker2")
    deadline = time.monotonic() + 30
    while not all((fake_app / f"{n}.json").exists() for n in names):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.1)
    pids = [json.loads((fake_app / f"{n}.json").read_text())["pid"] for n in names]
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_local_killed_with_sigkill_takes_its_processes_with_it(fake_app: Path) -> None:
    """Each process of the job gets SIGTERM when its launcher dies (before: they ran in
    sessions of their own, with PPID 1, training on to the end with nobody to stop them)."""
    p = _orchestrator(fake_app, "local", "-c", "topo.yaml", FAKE_SLEEP="1")
    names = ("ps", "worker1", "worker2")
    deadline = time.monotonic() + 30
    while not all((fake_app / f"{n}.json").exists() for n in names):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.1)
    pids = [json.loads((fake_app / f"{n}.json").read_text())["pid"] for n in names]
    p.kill()
    p.communicate(timeout=30)
    deadline = time.monotonic() + 30
    while alive := [pid for pid in pids if _running(pid)]:
        assert time.monotonic() < deadline, f"still running 30 s after their launcher's SIGKILL: {alive}"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """`pid` is a process that has not exited (a zombie waiting for init has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _dead_pid() -> int:
    """The pid of a process that has ended (and been waited for)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_the_next_run_removes_what_a_killed_run_of_any_name_left_in_dev_shm_and_nothing_live(tmp_path: Path) -> None:
    """A launcher killed with SIGKILL cannot remove its run's /dev/shm directory: the next run,
    of any name, does; it leaves one whose launcher lives, one that a live process maps, and
    another account's. In the older naming (no pid), the next run of the name does."""
    t = load(REPO / "configs" / "cpu-smoke.yaml").with_name(f"shm-test-{os.getpid()}")
    dead = _dead_pid()
    left = local.shm_dir(t, "20261202-010203-abcdef", launcher=dead)
    other_name = local.SHM_ROOT / f"psc-{dead}-other-{os.getpid()}-20261202-010203-abcdef"
    launcher_lives = local.shm_dir(t, "20261202-010204-123456")  # this process's: a live run's
    mapped = local.SHM_ROOT / f"psc-{dead}-mapped-{os.getpid()}-20261202-010205-654321"
    older = local.SHM_ROOT / f"psc-{t.name}-20261202-010206-abcdef"
    older_other = local.SHM_ROOT / f"psc-{t.name}-x-20261202-010207-654321"  # the topology `<name>-x`
    made = [left, other_name, launcher_lives, mapped, older, older_other]
    try:
        for d in made:
            d.mkdir()
            (d / "segment").write_bytes(b"\0" * 4096)
        with open(mapped / "segment", "r+b") as f, mmap.mmap(f.fileno(), 4096):
            assert sorted(local.remove_stale_shm(t)) == sorted([left, other_name, older])
            assert [d.exists() for d in made] == [False, False, True, True, False, True]
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(
    os.geteuid() != 0 and os.environ.get("CI") != "true",
    reason="makes a directory as another account (needs root; CI: fails)",
)
def test_another_accounts_run_directory_is_left_alone(tmp_path: Path) -> None:
    t = load(REPO / "configs" / "cpu-smoke.yaml").with_name(f"shm-other-{os.getpid()}")
    theirs = local.shm_dir(t, "20261202-010203-abcdef", launcher=_dead_pid())
    try:
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        assert local.remove_stale_shm(t) == [] and theirs.exists()
    finally:
        shutil.rmtree(theirs, ignore_errors=True)


def test_local_missing_data_dir_starts_nothing(fake_app: Path) -> None:
    (fake_app / "topo.yaml").write_text(
        yaml.safe_dump(topology(train={"dataset": "imagefolder", "data_dir": "./nope"}))
    )
    p = _orchestrator(fake_app, "local", "-c", "topo.yaml")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and out == ""
    assert len(err.splitlines()) == 1 and "train.data_dir: got './nope'; no such directory" in err
    assert not (fake_app / "runs").exists() and not (fake_app / "ps.json").exists()


def test_local_app_failure_is_nonzero(fake_app: Path) -> None:
    (fake_app / "app" / "__main__.py").write_text("import sys; sys.exit(1 if sys.argv[1] == 'worker' else 0)\n")
    p = _orchestrator(fake_app, "local", "-c", "topo.yaml")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1 and "exited with code 1" in out


@pytest.mark.slow
def test_local_cpu_smoke_trains(tmp_path: Path) -> None:
    """The real app: PS + 2 workers as processes reach >= 0.90 held-out accuracy on digits."""
    p = subprocess.run(
        [sys.executable, "-m", "orchestrator", "local", "-c", str(REPO / "configs/cpu-smoke.yaml"), "--workers", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    final = re.findall(r"^ps +\| Accuracy: ([0-9.]+)$", p.stdout, re.M)
    assert final and float(final[-1]) >= 0.90, p.stdout[-3000:]
    assert (tmp_path / "runs" / "cpu-smoke" / "checkpoints" / "final.pt").is_file()


def _child_with_rank(parent: int, rank: int) -> int | None:
    """The pid of `parent`'s child process whose environment has PSC_RANK=`rank`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0") if ppid == parent else []
        except (OSError, IndexError, ValueError):
            continue
        if f"PSC_RANK={rank}".encode() in env:
            return int(entry.name)
    return None


@pytest.mark.slow
@host_has(Path("/proc/self/environ").exists(), "/proc, to find the worker's process")
def test_local_restarts_a_killed_worker_which_rejoins_and_the_run_finishes_0(tmp_path: Path) -> None:
    """kill -9 worker2 of a real `local` run mid-training: the supervisor starts it again,
    it rejoins the PS under a new RPC name and trains, and the run ends 0 at the usual accuracy."""
    topo = yaml.safe_load((REPO / "configs/cpu-smoke.yaml").read_text())
    topo["train"]["epochs"] = 30  # long enough to be killed mid-run
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    p = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "local", "-c", "topo.yaml", "--workers", "2"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        for line in p.stdout:  # until worker2 has trained a few epochs
            lines.append(line)
            if re.match(r"worker2 +\| worker2 \| Epoch: 3 \| ", line):
                break
        pid = _child_with_rank(p.pid, 2)
        assert pid is not None, "".join(lines[-50:])
        os.kill(pid, signal.SIGKILL)
        lines.extend(p.stdout)
        p.wait(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out = "".join(lines)
    assert p.returncode == 0, out[-4000:]
    assert "worker2 | exited with code -9; restarting (1 of 3)" in out, out[-4000:]
    assert re.search(r"^ps +\| .*dropped worker2 \(rank 2\)", out, re.M), out[-4000:]
    assert re.search(r"^ps +\| .*worker2_r2 \(rank 2\) joined at version", out, re.M), out[-4000:]
    after = out[out.index("restarting (1 of 3)") :]
    assert re.search(r"^worker2 +\| worker2 \| Epoch: \d+ \| Batch: \d+ \| Loss: ", after, re.M), after[-4000:]
    assert re.search(r"^worker2 +\| exited with code 0$", out, re.M)
    final = re.findall(r"^ps +\| Accuracy: ([0-9.]+)$", out, re.M)
    assert final and float(final[-1]) >= 0.90, out[-3000:]


def test_a_local_run_says_where_its_ps_logs_when_the_topology_asks_for_the_own_mlflow_server() -> None:
    smoke = load(REPO / "configs" / "cpu-smoke.yaml")
    tracked = smoke.model_copy(update={"tracking": Tracking(mlflow=True)})
    assert local.tracking_note(smoke, {"MLFLOW_TRACKING_URI": "http://h:5000"}) is None
    assert local.tracking_note(tracked, {}) == (
        "tracking.mlflow: the project's own MLflow server is a compose service; "
        "the PS logs to nowhere (MLFLOW_TRACKING_URI is not set)"
    )
    said = local.tracking_note(tracked, {"MLFLOW_TRACKING_URI": "http://h:5000"})
    assert said is not None and said.endswith("the PS logs to http://h:5000")


def test_version_prints_the_installed_version_and_exits_0(capsys) -> None:
    from importlib import metadata

    from orchestrator.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.split()[-1] == metadata.version("ps-compose")


@pytest.mark.parametrize("verb", ["logs", "down", "status"])
def test_a_verb_on_a_name_with_no_run_is_one_line_and_exit_2(verb, capsys, tmp_path, monkeypatch) -> None:
    from orchestrator.cli import main

    monkeypatch.chdir(tmp_path)  # no runs/ here
    assert main([verb, "--name", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: no project named 'nosuch' here: runs/nosuch/compose.yaml does not exist (`ps-compose runs` lists "
        "the runs; `ps-compose up --name nosuch` starts one)"
    ], err
