"""The orchestrator's Docker reads while the engine removes containers under them: the SDK lists
containers with one call and inspects each with another, so a container a restart policy, a
swarm task's replacement or `scale` removes in between answered 404 and the whole read failed
(a two-node swarm run's `records` failed so, mid-run). The reads take the containers that are
still there. Real docker SDK collections over an engine API that removes one container between
its list and its inspect."""

from __future__ import annotations

import io
import json
import tarfile
from types import SimpleNamespace

import docker
import pytest
from docker.models.containers import ContainerCollection
from docker.models.networks import NetworkCollection
from docker.models.services import ServiceCollection

from orchestrator.backends.compose import adapter as compose_adapter
from orchestrator.backends.swarm import adapter as swarm_adapter
from orchestrator.chaos import soak_job

RECORD = {"time": 1.0, "role": "ps", "rank": 0, "event": "end", "step": 7, "accuracy": 0.97}


def metrics_tar() -> bytes:
    data = (json.dumps(RECORD) + "\n").encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("metrics/ps.jsonl")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class RemovingApi:
    """An engine where container `gone` is listed, then removed before its inspect."""

    def __init__(self) -> None:
        self.removed: list[str] = []

    def containers(self, **_filters):
        return [{"Id": "gone"}, {"Id": "kept"}]

    def inspect_container(self, container_id):
        if container_id == "gone":
            raise docker.errors.NotFound(f"No such container: {container_id}")
        return {"Id": container_id, "Name": "/kept", "Created": "2026-11-27T00:00:00Z", "Config": {"Labels": {}}}

    def get_archive(self, container_id, path, *_args, **_kwargs):
        return iter([metrics_tar()]), {"name": "metrics"}

    def remove_container(self, container_id, **_options):
        self.removed.append(container_id)

    def services(self, **_filters):
        return []

    def networks(self, *_args, **_kwargs):
        return []


class RemovingClient:
    """docker.DockerClient's collections, over RemovingApi."""

    def __init__(self) -> None:
        self.api = RemovingApi()
        self.containers = ContainerCollection(client=self)
        self.services = ServiceCollection(client=self)
        self.networks = NetworkCollection(client=self)


def test_the_sdk_fails_a_listing_whose_container_went_in_between():
    """The race itself, as the SDK's default reads it."""
    with pytest.raises(docker.errors.NotFound):
        RemovingClient().containers.list(all=True)


def test_a_project_s_containers_are_those_still_there():
    assert [c.id for c in compose_adapter.containers(RemovingClient(), "cpu-smoke")] == ["kept"]


def test_a_swarm_service_s_metrics_are_read_from_a_container_still_there():
    files = swarm_adapter.read_metrics(RemovingClient(), "cpu-smoke", "ps")
    assert [json.loads(line) for line in files["ps.jsonl"]] == [RECORD]


def test_swarm_leftovers_are_what_is_still_there():
    assert swarm_adapter.leftovers(RemovingClient(), "cpu-smoke") == ["container kept"]


def test_the_soak_removes_the_keeper_still_there():
    job = soak_job.SoakJob.__new__(soak_job.SoakJob)  # its engine calls only, no job rendered
    job.client, job.project = RemovingClient(), SimpleNamespace(name="soak")
    job.remove_keeper()
    assert job.client.api.removed == ["kept"] and job.keeper is None
