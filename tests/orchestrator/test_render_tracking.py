"""`tracking.mlflow: true`: the project's own MLflow tracking server in the compose render, what
the PS gets from it, the targets that refuse it, and the context its image is built from."""

from __future__ import annotations

import io
import tarfile

import pytest
import yaml

from orchestrator import images, tracking_image
from orchestrator.backends.compose.status import service_states
from orchestrator.render import compose as render_compose
from orchestrator.render import tracking
from orchestrator.topology.model import parse

from orch_helpers import topology, training


def tracked(**sections):
    return parse(yaml.safe_dump(topology(tracking={"mlflow": True}, **sections)))


def test_the_own_server_is_a_service_on_its_volume_published_on_loopback_that_the_ps_waits_for(schema_validator):
    t = tracked()
    doc = render_compose.render(t)
    server, ps = doc["services"]["mlflow"], doc["services"]["ps"]
    assert server["image"] == "ps-compose-mlflow:latest" and "build" not in server and "profiles" not in server
    assert server["volumes"] == [{"type": "volume", "source": "mlflow", "target": "/mlflow"}]
    assert doc["volumes"]["mlflow"] == {"labels": {"ps-compose.project": "t"}}
    assert server["ports"] == ["127.0.0.1:${PSC_MLFLOW_PORT:-5000}:5000"]  # the UI on the host's loopback only
    command = server["command"]
    assert command[command.index("--backend-store-uri") + 1] == "sqlite:////mlflow/mlflow.db"
    assert command[command.index("--artifacts-destination") + 1] == "/mlflow/artifacts"
    assert "mlflow:5000" in command[command.index("--allowed-hosts") + 1].split(",")  # the PS's Host header
    for key in ("user", "cap_drop", "security_opt", "networks"):
        assert server[key] == ps[key], key
    assert "runs/search" in " ".join(server["healthcheck"]["test"])
    # The PS logs to it unless the call names another server, and starts once it answers.
    assert ps["environment"]["MLFLOW_TRACKING_URI"] == "${MLFLOW_TRACKING_URI:-http://mlflow:5000}"
    assert ps["depends_on"]["mlflow"] == {"condition": "service_healthy"}
    assert "mlflow" not in training(doc) and all(
        "mlflow" not in s.get("depends_on", {}) for n, s in training(doc).items() if n != "ps"
    )
    assert list(schema_validator.iter_errors(yaml.safe_load(render_compose.dump(doc, t.name)))) == []


def test_auth_asks_every_request_for_the_callers_user_and_password_and_writes_neither(schema_validator):
    """tracking.auth: MLflow's basic auth on the project's server, its admin the caller's
    MLFLOW_TRACKING_USERNAME (default admin) and MLFLOW_TRACKING_PASSWORD, which the PS logs with;
    the file holds their names only."""
    t = parse(yaml.safe_dump(topology(tracking={"mlflow": True, "auth": True})))
    doc = render_compose.render(t)
    server, ps = doc["services"]["mlflow"], doc["services"]["ps"]
    assert server["entrypoint"][:2] == ["/bin/sh", "-c"] and "--app-name basic-auth" in server["entrypoint"][2]
    assert server["environment"]["MLFLOW_AUTH_ADMIN_USERNAME"] == "${MLFLOW_TRACKING_USERNAME:-admin}"
    assert server["environment"]["MLFLOW_AUTH_ADMIN_PASSWORD"] == "${MLFLOW_TRACKING_PASSWORD:-}"
    assert ps["environment"]["MLFLOW_TRACKING_USERNAME"] == "${MLFLOW_TRACKING_USERNAME:-admin}"
    assert ps["environment"]["MLFLOW_TRACKING_PASSWORD"] is None  # compose: the caller's
    assert "Authorization" in server["healthcheck"]["test"][-1]  # the probe logs in as the admin
    assert list(schema_validator.iter_errors(yaml.safe_load(render_compose.dump(doc, t.name)))) == []
    unguarded = render_compose.render(tracked())["services"]["mlflow"]
    assert "entrypoint" not in unguarded and "MLFLOW_AUTH_ADMIN_PASSWORD" not in unguarded["environment"]


def test_auth_is_refused_in_one_line_without_the_servers_own_or_a_password_mlflow_takes(cli, write_config):
    config = write_config(topology(tracking={"auth": True}))
    status, out, err = cli("render", "-c", str(config), "-o", "out.yaml")
    assert status == 2 and len(err.splitlines()) == 1 and "tracking.auth: got True" in err, err
    assert "needs tracking.mlflow: true" in err
    t = parse(yaml.safe_dump(topology(tracking={"mlflow": True, "auth": True})))
    assert "MLFLOW_TRACKING_PASSWORD is not set" in tracking.auth_refusal(t, {})
    assert "is 11 characters" in tracking.auth_refusal(t, {"MLFLOW_TRACKING_PASSWORD": "x" * 11})
    assert tracking.auth_refusal(t, {"MLFLOW_TRACKING_PASSWORD": "x" * 12}) is None
    assert tracking.auth_refusal(tracked(), {}) is None


def test_up_with_auth_and_no_password_is_refused_before_anything_starts(cli, write_config, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    config = write_config(topology(tracking={"mlflow": True, "auth": True}))
    status, out, err = cli("up", "-c", str(config))
    assert status == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: tracking.auth: got true; MLFLOW_TRACKING_PASSWORD is not set")


def test_without_tracking_no_server_is_rendered_and_the_ps_logs_only_where_the_call_says():
    t = parse(yaml.safe_dump(topology()))
    doc = render_compose.render(t)
    assert "mlflow" not in doc["services"] and set(doc["volumes"]) == {"state", "exchange"}
    assert doc["services"]["ps"]["environment"]["MLFLOW_TRACKING_URI"] == "${MLFLOW_TRACKING_URI:-}"


@pytest.mark.parametrize("target", ["swarm", "kubernetes"])
def test_other_targets_refuse_the_own_server_in_one_line(cli, write_config, target):
    config = write_config(topology(tracking={"mlflow": True}))
    status, out, err = cli("render", "-c", str(config), "--target", target, "-o", "out.yaml")
    assert status == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: tracking.mlflow: got true; the project's own MLflow server runs with the compose "
                          f"target only, not --target {target}")  # fmt: skip


def test_the_server_is_no_part_of_the_run_for_status_and_the_waits():
    """`make status`, `make logs` (which ends once every service of the run has ended) and the
    waits for a run's end leave the server out: it outlives the run."""

    def container(service, status, exit_code=0):
        labels = {"com.docker.compose.service": service, "com.docker.compose.project": "t"}
        state = {"Status": status, "ExitCode": exit_code}
        config = {"Labels": labels, "Env": []}
        return {"Name": f"/t-{service}-1", "Created": "2026-11-28", "RestartCount": 0, "State": state, "Config": config}

    states = service_states([container("ps", "exited"), container("worker1", "exited"), container("mlflow", "running")])
    assert sorted(s.service for s in states) == ["ps", "worker1"] and all(s.ended for s in states)
    assert tracking.MLFLOW_SERVICE in render_compose.SERVING


def test_the_image_context_holds_the_dockerfile_the_lock_and_offline_only_the_wheels(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "mlflow-3.0.0-py3-none-any.whl").write_bytes(b"wheel")
    monkeypatch.setattr(tracking_image, "WHEELHOUSE", wheels)
    for offline in (False, True):
        buffer = io.BytesIO()
        tracking_image.write_context(buffer, with_wheels=offline)
        buffer.seek(0)
        with tarfile.open(fileobj=buffer) as tar:
            names = sorted(tar.getnames())
            dockerfile = tar.extractfile("Dockerfile").read()
        expected = ["Dockerfile", "build/requirements.py", "build/tracking-server.txt"]
        if offline:
            expected.append("build/wheels/mlflow-3.0.0-py3-none-any.whl")
        assert names == expected
        assert dockerfile == tracking_image.DOCKERFILE.read_bytes()
    lock = (tracking_image.LOCK).read_text()
    assert "\nmlflow==" in lock and "--hash=sha256:" in lock


def test_the_image_key_changes_with_the_base_and_the_pip_source():
    offline = tracking_image.key(images.OFFLINE_BASE, "wheelhouse")
    assert offline == tracking_image.key(images.OFFLINE_BASE, "wheelhouse")
    assert (
        len(
            {
                offline,
                tracking_image.key("pytorch/pytorch:x", "index"),
                tracking_image.key(images.OFFLINE_BASE, "index"),
            }
        )
        == 3
    )
