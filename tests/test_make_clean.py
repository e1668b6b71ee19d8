"""`make clean` removes runs/ and the caches the commands write, and nothing else: not the
venv, not data/, not the sources (the real Makefile, run in a copy of the tree's layout)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Paths as parts: they are made by the test, not files of the repository.
REMOVED = [
    ("runs", "cpu-smoke", "compose.yaml"),
    ("runs", "current.json"),
    (".cache", "uv-0.13.8", "bin", "uv"),
    ("images", ".cache", "debootstrap", "x.deb"),
    ("images", "wheelhouse", "numpy.whl"),
    (".pytest_cache", "v", "x"),
    (".mypy_cache", "3.11", "x.json"),
    (".ruff_cache", "x"),
    ("app", "__pycache__", "x.pyc"),
    ("tests", "app", "__pycache__", "x.pyc"),
]
KEPT = [
    (".venv", "lib", "python3.11", "site-packages", "x", "__pycache__", "x.pyc"),
    (".venv", ".dev"),
    ("data", "sample-imagenette", "train", "0", "a.png"),
    ("data", "x", "__pycache__", "y.pyc"),
    ("app", "__init__.py"),
    ("requirements", "dev.txt"),
    ("images", "Dockerfile"),
]


def test_make_clean_removes_runs_and_caches_and_keeps_the_venv_and_data(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for parts in REMOVED + KEPT:
        (tmp_path.joinpath(*parts)).parent.mkdir(parents=True, exist_ok=True)
        tmp_path.joinpath(*parts).write_text("x")
    r = subprocess.run(["make", "clean"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert [p for p in REMOVED if tmp_path.joinpath(*p).exists()] == []
    assert [p for p in KEPT if not tmp_path.joinpath(*p).exists()] == []
    assert not (tmp_path / "runs").exists() and not (tmp_path / "app" / "__pycache__").exists()
