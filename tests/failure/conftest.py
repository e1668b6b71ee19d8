"""`engine`: a Docker client, or the test fails under CI=true (`.ci/run`: container
tests never skip there) and is skipped elsewhere (as in tests/containers)."""

import pytest

from needs import unavailable


@pytest.fixture(scope="session")
def docker_engine():
    from orchestrator import images
    from orchestrator.errors import EngineError

    try:
        return images.client(timeout=600)
    except EngineError as e:
        unavailable(f"no Docker engine answers: {e}")


@pytest.fixture(autouse=True)
def forked_app_processes(monkeypatch):
    """The chaos drills' app processes forked from tests/app/forkserver.py's server (torch
    imported once), as the app tests' are: the same processes, ~3 CPU-s less each."""
    import forkserver

    from orchestrator.chaos import processes

    monkeypatch.setattr(processes, "spawn", forkserver.spawn)
