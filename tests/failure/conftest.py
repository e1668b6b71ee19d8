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
