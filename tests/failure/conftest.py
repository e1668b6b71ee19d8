"""`engine`: a Docker client, or the test fails under CI=true (`.ci/run`: container
tests never skip there) and is skipped elsewhere (as in tests/containers)."""

import os

import pytest


@pytest.fixture(scope="session")
def docker_engine():
    from orchestrator import images
    from orchestrator.errors import EngineError

    try:
        return images.client(timeout=600)
    except EngineError as e:
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true and no Docker engine answers: {e}", pytrace=False)
        pytest.skip(f"no Docker engine: {e}")
