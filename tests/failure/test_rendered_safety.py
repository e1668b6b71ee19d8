"""Safe defaults of the rendered compose file that tests/orchestrator/test_render.py
does not already check: restarts, the failure knobs, no host namespaces, no secrets."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.render import compose as render_compose
from orchestrator.topology.model import load

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["configs/default.yaml", "configs/cpu-smoke.yaml"]


@pytest.mark.parametrize("config", CONFIGS)
def test_every_service_restarts_on_failure_and_the_ps_has_time_to_checkpoint(config):
    doc = render_compose.render(load(REPO / config))
    for name, svc in doc["services"].items():
        assert svc["restart"] == "on-failure", name
        assert svc["init"] is True  # SIGTERM reaches Python: `make down` stops in seconds
    assert doc["services"]["ps"]["stop_grace_period"] == "30s"  # > the PS's 20 s SIGTERM grace


@pytest.mark.parametrize("config", CONFIGS)
def test_timeouts_and_checkpoints_reach_every_process(config):
    t = load(REPO / config)
    for svc in render_compose.render(t)["services"].values():
        env = svc["environment"]
        assert env["PSC_RPC_TIMEOUT"] == str(t.ps.rpc_timeout)
        assert env["PSC_JOIN_TIMEOUT"] == str(t.ps.join_timeout)
        assert env["PSC_CHECKPOINT_EVERY"] == str(t.ps.checkpoint_every)
        assert env["PSC_CHECKPOINT_DIR"].startswith("/state/")  # on the named volume


@pytest.mark.parametrize("config", CONFIGS)
def test_no_host_namespaces_devices_or_extra_privileges(config):
    for name, svc in render_compose.render(load(REPO / config))["services"].items():
        for key in ("privileged", "network_mode", "pid", "ipc", "devices", "cap_add", "ports", "userns_mode"):
            assert key not in svc, (name, key)
        assert svc["user"] != "root" and not svc["user"].startswith("0")


@pytest.mark.parametrize("config", CONFIGS)
def test_no_secret_reaches_the_compose_file(config, monkeypatch):
    # The render reads nothing from the environment: a secret in it stays out of the file.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak-1234")
    monkeypatch.setenv("PSC_PASSWORD", "do-not-leak-5678")
    t = load(REPO / config)
    text = render_compose.dump(render_compose.render(t), t.name)
    assert "do-not-leak" not in text
    doc = yaml.safe_load(text)
    assert "secrets" not in doc
    for svc in doc["services"].values():
        assert "env_file" not in svc and "secrets" not in svc
        assert not [k for k in svc["environment"] if any(w in k.upper() for w in ("SECRET", "PASSWORD", "TOKEN"))]
