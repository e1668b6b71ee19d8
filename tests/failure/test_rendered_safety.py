"""Safe defaults of the rendered compose file that tests/orchestrator/test_render.py
does not already check: restarts, the failure knobs, no host namespaces, no secrets."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.render import compose as render_compose
from orchestrator.render import tracking as render_tracking
from orchestrator.topology.model import load
from orchestrator.topology.services import PIDNS_SERVICE

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["configs/default.yaml", "configs/cpu-smoke.yaml"]
# Not processes of the job: the holder of its PID namespace, and `make tensorboard`'s service.
HELPERS = (PIDNS_SERVICE, render_compose.TENSORBOARD_SERVICE)


def _job(doc: dict) -> dict:
    return {name: svc for name, svc in doc["services"].items() if name not in HELPERS}


@pytest.mark.parametrize("config", CONFIGS)
def test_every_service_restarts_on_failure_and_the_ps_has_time_to_checkpoint(config):
    doc = render_compose.render(load(REPO / config))
    for name, svc in _job(doc).items():
        assert svc["restart"] == "on-failure", name
        # SIGTERM reaches Python (`make down` stops in seconds): an init of its own, or the app
        # as the container's process in the PID namespace whose init is the pidns service's
        assert svc["init"] is True or (svc["pid"] == f"service:{PIDNS_SERVICE}" and svc["init"] is False)
    assert doc["services"][PIDNS_SERVICE]["init"] is True and doc["services"][PIDNS_SERVICE]["restart"] == "on-failure"
    assert doc["services"]["ps"]["stop_grace_period"] == "30s"  # > the PS's 20 s SIGTERM grace


@pytest.mark.parametrize("config", CONFIGS)
def test_timeouts_and_checkpoints_reach_every_process(config):
    t = load(REPO / config)
    for svc in _job(render_compose.render(t)).values():
        env = svc["environment"]
        assert env["PSC_RPC_TIMEOUT"] == str(t.ps.rpc_timeout)
        assert env["PSC_JOIN_TIMEOUT"] == str(t.ps.join_timeout)
        assert env["PSC_CHECKPOINT_EVERY"] == str(t.ps.checkpoint_every)
        assert env["PSC_CHECKPOINT_DIR"].startswith("/state/")  # on the named volume


@pytest.mark.parametrize("config", CONFIGS)
def test_no_host_namespaces_devices_or_extra_privileges(config):
    """Nothing of the host's: no host namespace, device, privilege or published port. What
    network.same_host_copy shares is the job's own PID and IPC namespaces (service:pidns; the
    holder's IPC namespace is `shareable`, never the host's), with no capability added;
    `make tensorboard` publishes on the loopback address only."""
    doc = render_compose.render(load(REPO / config))
    for name, svc in doc["services"].items():
        for key in ("privileged", "devices", "userns_mode"):
            assert key not in svc, (name, key)
        own_ipc = "shareable" if name == PIDNS_SERVICE else f"service:{PIDNS_SERVICE}"
        assert svc.get("ipc", own_ipc) == own_ipc, name
        assert svc.get("pid", f"service:{PIDNS_SERVICE}") == f"service:{PIDNS_SERVICE}", name
        assert "cap_add" not in svc, name
        assert svc.get("network_mode", "none") == "none", name
        assert all(p.startswith("127.0.0.1:") for p in svc.get("ports", [])), name
        assert svc["user"] != "root" and not svc["user"].startswith("0")
        assert svc["cap_drop"] == ["ALL"] and svc["security_opt"] == ["no-new-privileges:true"], name
    assert "pid" not in doc["services"][PIDNS_SERVICE]


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
        # MLflow's credentials are passed by name only (null: compose takes them from its caller).
        secrets = {
            k: v
            for k, v in svc.get("environment", {}).items()
            if any(w in k.upper() for w in ("SECRET", "PASSWORD", "TOKEN"))
        }
        # The run's secret is a file on the job's private tmpfs volume, made by the PS: its path only.
        if "PSC_SECRET_FILE" in secrets:
            assert secrets.pop("PSC_SECRET_FILE") == "/run/psc/secret"
            assert any(v["target"] == "/run/psc" and v["source"] == "exchange" for v in svc["volumes"]), svc
        assert all(v is None and k in render_tracking.FROM_CALLER for k, v in secrets.items()), secrets
