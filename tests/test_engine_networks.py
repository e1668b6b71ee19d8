"""The holds on the host engine's networks (tests/engine_networks.py): a `docker swarm leave`
waits for every test that has a project up, across processes, and none starts during it."""

import subprocess
import sys
import textwrap
from pathlib import Path

import engine_networks
import pytest


@pytest.fixture
def locks(tmp_path, monkeypatch):
    """The holds on files of this test's own, so a suite running beside it is not touched."""
    monkeypatch.setattr(engine_networks, "LOCK", tmp_path / "networks.lock")
    monkeypatch.setattr(engine_networks, "GATE", tmp_path / "networks.gate")
    return tmp_path


def hold_in_another_process(locks, kind: str, wait_s: float = 5.0) -> subprocess.Popen:
    """A process that takes `kind` (using or alone) and keeps it until its stdin closes, saying
    each step on its stdout and in the shared file `locks/said` ('KIND asks', 'KIND held',
    'KIND lets go'): the file's lines give the order across processes."""
    code = textwrap.dedent(f"""
        import sys, engine_networks
        from pathlib import Path
        engine_networks.LOCK = Path({str(locks / "networks.lock")!r})
        engine_networks.GATE = Path({str(locks / "networks.gate")!r})
        def say(what):
            with open({str(locks / "said")!r}, "a") as f:
                f.write(f"{kind} {{what}}\\n")
            print(what, flush=True)
        hold = engine_networks.using_networks() if {kind!r} == "using" else engine_networks.alone_on_networks({wait_s})
        say("asks")
        with hold:
            say("held")
            sys.stdin.read()
            say("lets go")
    """)
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(Path(engine_networks.__file__).parent)},
    )
    assert p.stdout.readline() == "asks\n"
    return p


def held(p: subprocess.Popen) -> bool:
    return p.stdout.readline() == "held\n"


def release(p: subprocess.Popen) -> None:
    p.stdin.close()
    assert p.stdout.readline() == "lets go\n"
    assert p.wait(timeout=30) == 0


def test_a_leave_waits_while_another_process_has_a_project_up(locks):
    user = hold_in_another_process(locks, "using")
    assert held(user)
    with pytest.raises(TimeoutError, match="still use the engine's networks after 0 s"):
        with engine_networks.alone_on_networks(wait_s=0.2):
            pass
    release(user)
    with engine_networks.alone_on_networks(wait_s=5):  # once it is done, the leave goes ahead
        pass


def test_several_processes_use_the_networks_at_once(locks):
    first = hold_in_another_process(locks, "using")
    assert held(first)
    second = hold_in_another_process(locks, "using")
    assert held(second)
    release(first)
    release(second)


def test_no_project_starts_while_a_leave_holds_the_networks(locks):
    leave = hold_in_another_process(locks, "alone")
    assert held(leave)
    user = hold_in_another_process(locks, "using")  # it asks while the leave holds them
    release(leave)
    assert held(user)
    release(user)
    said = (locks / "said").read_text().splitlines()
    assert said.index("using held") > said.index("alone lets go"), said


def test_holds_in_one_process_nest_and_a_leave_inside_one_refuses(locks):
    with engine_networks.using_networks(), engine_networks.using_networks():
        with pytest.raises(RuntimeError, match="would wait on itself"):
            with engine_networks.alone_on_networks(wait_s=0.2):
                pass
    with engine_networks.alone_on_networks(wait_s=0.2):  # every nested hold was let go
        pass
