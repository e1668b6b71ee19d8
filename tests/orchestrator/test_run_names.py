"""Runs that share a name: `--name` (`make ... NAME=`) on every verb that takes a topology,
validated as the topology's `name:`; one live run per name (a second `up` of a live one is
refused in one line); `--name` alone finds the last up of that name; a scale that comes after
the run's end says so in one line and leaves nothing half-made; `logs` into a file or a pipe
writes no terminal escapes. On a made-up target (the blocks only) and the real CLI parser."""

from __future__ import annotations

import io
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from test_backends import FakeBackend, ReadLines

from orchestrator import paths
from orchestrator.backends import registry
from orchestrator.backends.base import ServiceState
from orchestrator.errors import EngineError, UsageError
from orchestrator.render.compose import STATE_VOLUME
from orchestrator.topology.model import load, parse
from orchestrator.topology.services import LABEL_PROJECT
from orchestrator.verbs import cluster as verbs
from orchestrator.verbs import scaling

from orch_helpers import REPO, cli  # noqa: F401 - cli is a fixture

SMOKE = REPO / "configs/cpu-smoke.yaml"
BAD_NAMES = ["My Run", "a\nb", "run\n", "-x", "x" * 51, ""]
NAME_RULE = "must be lowercase letters, digits, '-' or '_', starting with a letter or digit, at most 50 characters"


@pytest.fixture
def fleet(monkeypatch, tmp_path: Path) -> FakeBackend:
    fake = FakeBackend()
    monkeypatch.setitem(registry.BACKENDS, "fake", fake)
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    return fake


# --- the name, validated -------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD_NAMES)
@pytest.mark.parametrize(
    "verb",
    [
        ["render", "-c", str(SMOKE)],
        ["up", "-c", str(SMOKE)],
        ["local", "-c", str(SMOKE)],
        ["logs"],
        ["status"],
        ["down"],
        ["scale", "--workers", "2"],
        ["tensorboard"],
        ["stack-up", "-c", str(SMOKE)],
        ["stack-status"],
        ["smoke"],
        ["chaos", "soak"],
        ["doctor", "-c", str(SMOKE)],
    ],
)
def test_a_bad_name_is_one_line_and_exit_2_on_every_verb(cli, tmp_path: Path, verb: list[str], bad: str) -> None:  # noqa: F811
    status, out, err = cli(*verb, f"--name={bad}")
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and f"--name: got {bad!r}; {NAME_RULE}" in err, err
    assert not (tmp_path / "runs").exists()


def test_the_topologys_name_is_one_line_too() -> None:
    """`name: "run\\n"` once passed (a regex's `$` matches before a trailing newline)."""
    text = SMOKE.read_text().replace("name: cpu-smoke", 'name: "cpu-smoke\\n"')
    with pytest.raises(UsageError, match=r"name: got 'cpu-smoke\\n'; must be lowercase") as e:
        parse(text, "t.yaml")
    assert "\n" not in str(e.value)


def test_render_with_a_name_names_the_project_and_its_volume_but_keeps_the_image(cli, tmp_path: Path) -> None:  # noqa: F811
    status, out, err = cli("render", "-c", str(SMOKE), "--name", "smoke-b", "-o", "c.yaml")
    assert status == 0, err
    assert "image ps-compose-cpu-smoke:latest, project smoke-b" in out
    doc = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert doc["volumes"][STATE_VOLUME]["labels"] == {LABEL_PROJECT: "smoke-b"}
    assert {s["image"] for s in doc["services"].values()} == {"ps-compose-cpu-smoke:latest"}
    t = load(SMOKE)
    assert t.with_name("smoke-b").image_tag == t.image_tag and t.with_name("smoke-b").name == "smoke-b"


# --- the make variable -----------------------------------------------------------------------

MAKE_VERBS = {
    "up": "up",
    "local": "local",
    "logs": "logs",
    "status": "status",
    "down": "down",
    "scale WORKERS=3": "scale",
    "render": "render",
    "tensorboard": "tensorboard",
    "build": "build",
    "doctor": "doctor",
    "check": "check",
    "smoke": "smoke",
    "soak": "chaos soak",
    "stack-up": "stack-up",
    "stack-down": "stack-down",
    "stack-logs": "stack-logs",
    "stack-status": "stack-status",
    "stack-scale": "stack-scale",
    "stack-smoke": "stack-smoke",
}


def _make_n(args: str, **env: str) -> str:
    """What `make -n ARGS` would run (the venv's stamps taken as made: nothing is installed)."""
    r = subprocess.run(
        ["make", "-n", "-o", ".venv/.host", "-o", ".venv/.dev", *args.split()],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("target", sorted(MAKE_VERBS))
def test_make_passes_name_to_every_verb_that_takes_a_topology(target: str) -> None:
    line = next(x for x in _make_n(f"{target} NAME=run-b").splitlines() if "-m orchestrator " in x)
    assert f"-m orchestrator {MAKE_VERBS[target]} " in line and "--name run-b" in line, line


def test_make_takes_name_from_its_command_line_only() -> None:
    """WSL puts NAME (the host's name) in every shell's environment."""
    assert "--name" not in _make_n("up", NAME="DESKTOP-1")
    assert "--name run-b" in _make_n("up NAME=run-b", NAME="DESKTOP-1")


# --- one live run per name -----------------------------------------------------------------


class Live(FakeBackend):
    """Fleets by name, each live while a ship of it sails (running_env as compose reads it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fleets: dict[str, dict[str, ServiceState]] = {}
        self.runs: dict[str, str] = {}

    def deploy(self, c, env, out):
        super().deploy(c, env, out)
        self.fleets[c.name], self.runs[c.name] = self.ships, env["PSC_RUN_ID"]
        return []

    def describe(self, c):
        return list(self.fleets.get(c.name, {}).values())

    def running_env(self, c, names):
        sailing = any(s.running for s in self.fleets.get(c.name, {}).values())
        return {"PSC_RUN_ID": self.runs[c.name], "PSC_RESUME": "false"} if sailing else {}

    def scale_to(self, c, start, stop, env) -> None:
        self.calls.append(("scale", (list(start), list(stop))))
        for name in start:
            self.fleets[c.name][name] = ServiceState(name, "running")

    def home(self, name: str) -> None:
        self.fleets[name] = {n: replace(s, status="exited", exit_code=0) for n, s in self.fleets[name].items()}


@pytest.fixture
def live(monkeypatch, tmp_path: Path) -> Live:
    fake = Live()
    monkeypatch.setitem(registry.BACKENDS, "fake", fake)
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    return fake


def test_a_second_up_of_a_live_name_is_refused_in_one_line(cli, live: Live) -> None:  # noqa: F811
    status, out, err = cli("fake-up", "-c", str(SMOKE))
    assert status == 0, err
    first = live.runs["fleet-cpu-smoke"]
    status, out, err = cli("fake-up", "-c", str(SMOKE))
    assert status == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err == (
        f"error: fake-up: fleet fleet-cpu-smoke has a live run {first} (ships running: ps worker1 worker2); "
        "give this one another name (make fake-up NAME=fleet-cpu-smoke-2), "
        "or end that one first (make fake-down NAME=fleet-cpu-smoke)\n"
    )
    assert [c[0] for c in live.calls] == ["deploy"]  # nothing started, nothing removed

    status, out, err = cli("fake-up", "-c", str(SMOKE), "--name", "b")  # another name: its own fleet
    assert status == 0, err
    assert "==> up: fleet fleet-b." in out


def test_a_smoke_of_a_live_name_is_refused_before_it_removes_anything(cli, live: Live) -> None:  # noqa: F811
    """The smoke removes its project (and volume) before and after its run: never a live one."""
    assert cli("fake-up", "-c", str(SMOKE), "--name", "x")[0] == 0
    status, out, err = cli("fake-smoke", "-c", str(SMOKE), "--name", "fleet-x")
    assert status == 2 and out == "" and err.startswith("error: fake-smoke: fleet fleet-x has a live run "), err
    assert [c[0] for c in live.calls] == ["deploy"]


def test_a_name_live_on_one_target_is_refused_on_every_other_and_by_local(cli, live: Live, monkeypatch) -> None:  # noqa: F811
    from orchestrator.verbs import live_names

    other = Live()
    other.name, other.verb_prefix, other.record = "other", "other-", "other.json"
    monkeypatch.setitem(registry.BACKENDS, "other", other)
    assert cli("fake-up", "-c", str(SMOKE))[0] == 0
    first = live.runs["fleet-cpu-smoke"]
    status, out, err = cli("other-up", "-c", str(SMOKE))
    assert status == 2 and out == "", err
    assert err == (
        f"error: other-up: fleet fleet-cpu-smoke of target fake has a live run {first}; "
        "give this one another name (make other-up NAME=fleet-cpu-smoke-2), "
        "or end that one first (make fake-down NAME=fleet-cpu-smoke)\n"
    )
    assert other.calls == []  # nothing deployed there
    with pytest.raises(UsageError, match=rf"^local: fleet fleet-cpu-smoke of target fake has a live run {first}; "):
        live_names.refuse_elsewhere(
            "fleet-cpu-smoke", live_names.LOCAL, "local", "--name x-2", registry.BACKENDS.values()
        )
    live.home("fleet-cpu-smoke")  # that run ended: the name is free everywhere
    assert cli("other-up", "-c", str(SMOKE))[0] == 0
    status, out, err = cli("fake-up", "-c", str(SMOKE))  # now live on the other target
    assert status == 2 and err.startswith("error: fake-up: fleet fleet-cpu-smoke of target other has a live run "), err


def test_a_target_that_cannot_tell_has_no_live_run_to_refuse() -> None:
    from orchestrator.verbs import live_names

    class NoEngine(FakeBackend):
        def running_env(self, c, names):
            raise EngineError("cannot reach the Docker daemon")

    assert live_names.live_on(NoEngine(), "x") is None
    live_names.refuse_elsewhere("x", live_names.LOCAL, "local", "--name x-2", [NoEngine()])  # nothing raised


def test_an_up_of_a_name_whose_run_ended_starts_a_new_run(cli, live: Live) -> None:  # noqa: F811
    assert cli("fake-up", "-c", str(SMOKE))[0] == 0
    first = live.runs["fleet-cpu-smoke"]
    live.home("fleet-cpu-smoke")
    status, out, err = cli("fake-up", "-c", str(SMOKE))
    assert status == 0, err
    again = live.runs["fleet-cpu-smoke"]
    assert again != first and f"run {again}: starts fresh at version 0" in out


def test_a_name_alone_finds_the_last_up_of_that_name(cli, live: Live, tmp_path: Path) -> None:  # noqa: F811
    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(SMOKE.read_text().replace("  count: 2", "  count: 2\n  max: 4"))
    assert cli("fake-up", "-c", str(scaled), "--name", "a")[0] == 0
    assert cli("fake-up", "-c", str(SMOKE), "--name", "b")[0] == 0  # the last up
    assert verbs.resolve(live, None, None).name == "fleet-b"
    a = verbs.resolve(live, None, None, name="fleet-a")
    assert (a.name, a.config) == ("fleet-a", str(scaled))
    assert (tmp_path / "runs" / "fleet-a" / "fake-up.json").is_file()
    status, out, err = cli("fake-scale", "--workers", "3", "--name", "fleet-a")  # needs a's workers.max
    assert status == 0, err
    assert "fleet fleet-a runs 3 of at most 4 workers (started worker3)" in out
    with pytest.raises(UsageError, match="no fleet named 'never-up' here: .* does not exist"):
        verbs.resolve(live, None, None, name="never-up")  # nothing of it on this host: one line, exit 2


# --- a scale that races the end of the run -------------------------------------------------


class Ending(Live):
    """A fleet whose PS exits 0 while `scale_to` starts the new ships: the engine fails, as
    compose does (`dependency failed to start: container ...-ps-1 exited (0)`), and leaves
    them created, never started."""

    def scale_to(self, c, start, stop, env) -> None:
        self.home(c.name)
        for name in start:
            self.fleets[c.name][name] = ServiceState(name, "created")
        raise EngineError("`docker compose up -d worker3` failed with exit status 1: dependency failed to start")

    def discard_created(self, c, services):
        fleet = self.fleets[c.name]
        gone = [n for n in services if n in fleet and fleet[n].status == "created"]
        for n in gone:
            del fleet[n]
        return gone


def test_a_scale_that_comes_as_the_run_ends_says_so_and_leaves_nothing_made(cli, monkeypatch, tmp_path) -> None:  # noqa: F811
    fake = Ending()
    monkeypatch.setitem(registry.BACKENDS, "fake", fake)
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(SMOKE.read_text().replace("  count: 2", "  count: 2\n  max: 4"))
    assert cli("fake-up", "-c", str(scaled))[0] == 0
    status, out, err = cli("fake-scale", "--workers", "4")
    ended = (
        "error: scale: the run of fleet fleet-cpu-smoke has ended (its PS exited 0): nothing to scale; "
        "make fake-status shows how it ended, make fake-up starts a new run\n"
    )
    assert (status, out, err) == (2, "", ended)
    fleet = fake.fleets["fleet-cpu-smoke"]
    assert sorted(fleet) == ["ps", "worker1", "worker2"] and all(s.ended for s in fleet.values())
    # and once it has ended, before anything is started: the same line
    status, out, err = cli("fake-scale", "--workers", "4")
    assert (status, out, err) == (2, "", ended)


def test_a_scale_after_the_run_wrote_its_end_but_before_its_ps_exited_starts_nothing(cli, monkeypatch, tmp_path):  # noqa: F811
    class Ended(Live):
        def read_records(self, c, service):
            mine = self.runs[c.name]
            lines = [
                {"time": 1.0, "event": "start", "step": 0, "run_id": "an-older-run"},
                {"time": 2.0, "event": "end", "step": 80},
                {"time": 3.0, "event": "start", "step": 0, "run_id": mine},
                {"time": 4.0, "event": "checkpoint", "step": 120, "file": "final.pt"},
            ]
            return {"ps.jsonl": [json.dumps(r) for r in lines]}

    fake = Ended()
    monkeypatch.setitem(registry.BACKENDS, "fake", fake)
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(SMOKE.read_text().replace("  count: 2", "  count: 2\n  max: 4"))
    assert cli("fake-up", "-c", str(scaled))[0] == 0
    status, out, err = cli("fake-scale", "--workers", "3")
    assert (status, out) == (2, "") and err.startswith(
        "error: scale: the run of fleet fleet-cpu-smoke has ended (its PS wrote its end): nothing to scale"
    ), err
    assert not [call for call in fake.calls if call[0] == "scale"]


def test_a_scale_whose_engine_fails_while_the_run_goes_on_fails_as_before(monkeypatch, tmp_path) -> None:
    class Failing(Live):
        def scale_to(self, c, start, stop, env) -> None:
            raise EngineError("`docker compose up` failed with exit status 1: no space left on device")

    fake = Failing()
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(SMOKE.read_text().replace("  count: 2", "  count: 2\n  max: 4"))
    assert verbs.up(fake, str(scaled), out=io.StringIO()) == 0
    assert scaling.scale(fake, None, 3) == 1  # engine_errors: one line, exit 1


# --- logs into a file or a pipe ----------------------------------------------------------------


def test_logs_into_a_file_writes_no_terminal_escapes(fleet: FakeBackend, tmp_path: Path) -> None:
    class Colored(FakeBackend):
        def log_iter(self, c, follow: bool, options=None):
            # compose v2 following: "\r\x1b[Kps-1 exited with code 0", its \r read as a line end
            lines = ["ps-1 | Accuracy: 0.9805\n", "\n", "\x1b[Kps-1 exited with code 0\n", "\x1b[32mw-1\x1b[0m | x\n"]
            return ReadLines(lines)

    with open(tmp_path / "logs.txt", "w", encoding="utf-8") as out:
        assert verbs.logs(Colored(), str(SMOKE), follow=False, out=out) == 0
    assert (tmp_path / "logs.txt").read_text() == "ps-1 | Accuracy: 0.9805\nps-1 exited with code 0\nw-1 | x\n"
