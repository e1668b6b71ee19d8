"""The package users install (issue 58): `pip install .` gives a `ps-compose` command with every
verb, its dependencies from pyproject.toml, and the project's own files (the image's build
context, the configs) beside it, so that it works from any directory."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from orchestrator import paths
from orchestrator.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
UV = ROOT / ".cache" / "uv-0.13.8" / "bin" / "uv"  # the Makefile's UV_VERSION, installed by make setup


def _data_files() -> set[str]:
    """Every file pyproject.toml's data-files installs, as a path relative to the checkout."""
    listed = PROJECT["tool"]["setuptools"]["data-files"]
    return {f for patterns in listed.values() for p in patterns for f in glob.glob(p, root_dir=ROOT)}


def _tracked(*dirs: str) -> set[str]:
    out = subprocess.run(["git", "ls-files", *dirs], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_command_is_the_orchestrators_cli_with_every_verb():
    assert PROJECT["project"]["scripts"] == {"ps-compose": "orchestrator.cli:main"}
    verbs = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert {"render", "doctor", "up", "down", "logs", "status", "local", "stack-up", "chaos"} <= verbs


def test_the_wheel_carries_every_file_of_the_build_context_and_the_configs():
    """A file added to app/, images/, requirements/ or configs/ and not to data-files fails here."""
    wanted = _tracked("app", "images", "requirements", "configs", ".dockerignore")
    assert wanted - _data_files() == set()
    for name, patterns in PROJECT["tool"]["setuptools"]["data-files"].items():
        # each file lands in share/ps-compose/<its own directory>: the checkout's layout
        assert all(Path(name).relative_to(paths.SHARE) == Path(p).parent for p in patterns), name


def test_from_a_checkout_the_project_files_and_the_runs_are_the_checkouts():
    assert paths.from_checkout()
    assert paths.HOME == paths.ROOT == ROOT
    assert paths.RUNS == ROOT / "runs"


def test_a_relative_config_missing_here_is_the_projects_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.config_file("configs/cpu-smoke.yaml") == ROOT / "configs" / "cpu-smoke.yaml"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "cpu-smoke.yaml").write_text("name: mine\n")
    assert paths.config_file("configs/cpu-smoke.yaml") == Path("configs/cpu-smoke.yaml")  # yours wins
    assert paths.config_file("nothing.yaml") == Path("nothing.yaml")  # "no such file" names it


def _install(into: Path, work: Path) -> Path:
    """A fresh venv with the package from a copy of the clone (a wheel built there, so nothing is
    written in the clone) and the orchestrator's dependencies from the lock; no torch."""
    src = work / "src"
    for name in ("pyproject.toml", "README.md", "LICENSE", ".dockerignore"):
        src.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    for name in ("app", "orchestrator", "images", "requirements", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "wheelhouse*", ".cache"))
    wheels = work / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(wheels)],
        check=True,
        cwd=work,
    )
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(into)], check=True)
    python = into / "bin" / "python"
    wheel = next(wheels.glob("ps_compose-*.whl"))
    if UV.is_file():
        base = [str(UV), "pip", "install", "-q", "--python", str(python), "--no-deps"]
    else:
        subprocess.run([str(python), "-m", "ensurepip"], check=True, capture_output=True)
        base = [str(python), "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*base, "--require-hashes", "-r", str(ROOT / "requirements" / "host.txt")], check=True)
    subprocess.run([*base, str(wheel)], check=True)
    return into / "bin" / "ps-compose"


@pytest.fixture
def work(tmp_path):
    """tmp_path, emptied afterwards: the venv and the wheel are about 150 MB."""
    yield tmp_path
    for child in tmp_path.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


@pytest.mark.slow
def test_the_installed_command_renders_and_checks_the_host_from_outside_the_clone(work):
    tmp_path = work
    command = _install(tmp_path / "venv", tmp_path)
    away = tmp_path / "away"
    away.mkdir()
    shutil.copy2(ROOT / "configs" / "cpu-smoke.yaml", away / "mine.yaml")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def ps_compose(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(command), *args], cwd=away, env=env, capture_output=True, text=True, timeout=300)

    where = subprocess.run(
        [
            str(tmp_path / "venv" / "bin" / "python"),
            "-c",
            "from orchestrator import paths; print(paths.HOME, paths.ROOT)",
        ],
        cwd=away,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert where == [str((tmp_path / "venv" / "share" / "ps-compose").resolve()), str(away.resolve())]
    assert (Path(where[0]) / "images" / "Dockerfile").is_file() and (Path(where[0]) / "app" / "__main__.py").is_file()

    r = ps_compose("render", "-c", "mine.yaml", "--workers", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("wrote compose.yaml: ps + 3 workers")
    assert "worker3:" in (away / "compose.yaml").read_text()

    r = ps_compose("render", "-c", "configs/cpu-smoke.yaml", "-o", "-")  # the project's own config
    assert r.returncode == 0 and "services:" in r.stdout, r.stderr

    r = ps_compose("doctor", "-c", "mine.yaml", "--no-probe")
    # exit 0 when every check passes, 1 when one fails (no engine here): one line per check either way
    assert r.returncode in (0, 1), r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "doctor: mine.yaml, ps + 2 workers, target compose"
    assert any(line.split()[:2] == ["ok", "data"] for line in lines), r.stdout
    assert lines[-1].startswith("doctor: "), r.stdout
    assert "Traceback" not in r.stderr

    r = ps_compose("render", "-c", "nothing.yaml")
    assert (r.returncode, r.stderr) == (2, "error: nothing.yaml: no such file\n")
    assert not (away / "runs").exists()  # render and doctor write no run
