"""What a killed export leaves, on a real engine: its container holds the project's state
volume, so `down -v` once said "volume removed" (exit 0) while compose only warned "Resource
is still in use" and the volume stayed. Now the project's one-off containers are removed
first, a volume something else still holds is an error naming it, and an export given SIGTERM
leaves by its clean-ups (SystemExit 143) instead of vanishing with its container running."""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from orchestrator.backends import export_container
from orchestrator.backends.compose import adapter
from orchestrator.topology.services import SCRATCH_LABEL

pytestmark = [pytest.mark.slow, pytest.mark.docker]


def _holder(engine, volume: str, labels: dict[str, str]):
    image = adapter._any_image(engine)
    assert image, "a ps-compose image is on the engine (the offline base's app image)"
    return engine.containers.create(image, command=["true"], volumes={volume: {"bind": "/state"}}, labels=labels)


def test_a_projects_scratch_containers_go_and_a_volume_held_by_another_is_named(engine):
    project = f"psc-scratch-{uuid.uuid4().hex[:8]}"
    volume = engine.volumes.create(f"{project}_state", labels={adapter.LABEL_PROJECT: project})
    scratch = _holder(engine, volume.name, {SCRATCH_LABEL: project})
    other = _holder(engine, volume.name, {SCRATCH_LABEL: "another-project"})
    try:
        assert adapter.remove_scratch(engine, project) == [scratch.name]
        assert [c.id for c in engine.containers.list(all=True, filters={"label": SCRATCH_LABEL})] == [other.id]
        assert adapter.volumes_left(engine, project) == [volume.name]
        other.remove(force=True)
        volume.remove()
        assert adapter.volumes_left(engine, project) == []
    finally:
        for c in engine.containers.list(all=True, filters={"volume": volume.name}):
            c.remove(force=True)
        for v in engine.volumes.list(filters={"label": f"{adapter.LABEL_PROJECT}={project}"}):
            v.remove(force=True)


def test_sigterm_during_an_export_is_a_systemexit_its_clean_ups_run_on():
    cleaned = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        with export_container._sigterm_as_exit():
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # delivered before the next line
                cleaned.append("not reached")
            finally:
                cleaned.append("container removed")
    assert stopped.value.code == 143 and cleaned == ["container removed"]
    assert signal.getsignal(signal.SIGTERM) == before
