"""A newcomer's first run, as the README tells it: a fresh clone in a temporary
directory, then the quick-start commands exactly as written (`make up
CONFIG=configs/cpu-smoke.yaml`, `make logs` to the end, `make status`, `make down`),
each under a non-login PATH (/usr/local/bin:/usr/bin:/bin, no sbin) and with none
of this checkout's venv. Nothing is prepared for it: the clone makes its own venv;
the image is whatever this engine has (in CI: the one built earlier in the same run,
from an offline base built from nothing).

`QUICK_START` is the README's block: when the README's commands change and this
test does not, `test_readme_quick_start_is_what_the_newcomer_runs` fails.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from orchestrator.backends.compose import adapter
from orchestrator.paths import ROOT

QUICK_START = [
    "make up CONFIG=configs/cpu-smoke.yaml",
    "make logs",
    "make status",
    "make down",
]
PROJECT = "cpu-smoke"  # the project cpu-smoke's `make up` starts (its topology's name)
VOLUME = f"{PROJECT}_state"
NEWCOMER_PATH = "/usr/local/bin:/usr/bin:/bin"


def readme_quick_start(readme: str) -> list[str]:
    """The commands of the first ```sh block under "## Quick start on CPU", comments dropped."""
    section = readme.split("## Quick start on CPU", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_readme_quick_start_is_what_the_newcomer_runs():
    assert readme_quick_start((ROOT / "README.md").read_text(encoding="utf-8")) == QUICK_START


def _newcomer_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")
    }
    env["PATH"] = NEWCOMER_PATH
    return env


def _run(command: str, cwd: str, timeout: float) -> str:
    r = subprocess.run(
        command, shell=True, cwd=cwd, env=_newcomer_env(), capture_output=True, text=True, timeout=timeout
    )
    out = r.stdout + r.stderr
    print(f"$ {command}  (exit {r.returncode})\n{out[-6000:]}")
    assert r.returncode == 0, f"`{command}` exited {r.returncode}:\n{out[-4000:]}"
    return r.stdout


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.xdist_group("engine-2")  # beside the group engine (tests/conftest.py): the project cpu-smoke is its own
def test_a_fresh_clone_runs_the_readme_quick_start(engine, tmp_path):
    if adapter.containers(engine, PROJECT):
        pytest.fail(
            f"a compose project {PROJECT!r} already has containers on this engine; "
            f"`make down` it first (the quick start uses that project)",
            pytrace=False,
        )
    volume_was_there = any(v.name == VOLUME for v in engine.volumes.list())
    clone = tmp_path / "ps-compose"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    up, logs, status, down = QUICK_START
    try:
        _run(up, str(clone), timeout=1500)
        text = _run(logs, str(clone), timeout=900)
        assert re.search(r"^\S+\s+\|\s+Accuracy: ", text, re.M), "the PS's final Accuracy line is not in make logs"
        # followed to the end, the run's report: drawn from the state volume's records, named in one line
        assert re.search(r"^==> report: loss.png, .*summary.txt in \S*runs/cpu-smoke/report/$", text, re.M), text
        assert (clone / "runs" / "cpu-smoke" / "report" / "loss.png").stat().st_size > 0

        lines = _run(status, str(clone), timeout=120).splitlines()
        header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["SERVICE"])
        table = [
            line for line in lines[header + 1 :] if line.strip() and not line.startswith(("live workers:", "progress:"))
        ]
        rows = {line.split()[0]: line.split() for line in table}
        assert sorted(rows) == ["ps", "worker1", "worker2"], lines
        for service, row in rows.items():
            assert row[1:3] == ["exited", "0"], f"{service}: {row}"
        assert float(rows["ps"][-1]) >= 0.90, lines  # make smoke's bar for cpu-smoke
        _run(down, str(clone), timeout=300)
        assert not adapter.containers(engine, PROJECT), "make down left containers"
    finally:
        subprocess.run(["make", "down"], cwd=clone, env=_newcomer_env(), capture_output=True, timeout=300)
        if not volume_was_there:
            subprocess.run(["docker", "volume", "rm", "-f", VOLUME], capture_output=True)
