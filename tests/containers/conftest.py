"""Fixtures of the container tests.

`engine`: a Docker client of a daemon that answers. When none answers, a test
that needs it FAILS under CI=true (`.ci/run` sets it: the container tests must
never skip there) and is skipped elsewhere (a laptop without Docker).
"""

import os

import pytest

SMOKE_CONFIG = "configs/cpu-smoke.yaml"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def engine():
    from orchestrator import images
    from orchestrator.errors import EngineError

    try:
        return images.client(timeout=600)
    except EngineError as e:
        if in_ci():
            pytest.fail(f"CI=true and no Docker engine answers: {e}", pytrace=False)
        pytest.skip(f"no Docker engine: {e}")


@pytest.fixture(scope="session")
def offline_image(engine):
    """The cpu-smoke image, built once per session on the offline path (fast when cached),
    so a warm machine never runs an image of older app code."""
    from orchestrator import images
    from orchestrator.paths import ROOT
    from orchestrator.spec.topology import load

    t = load(os.path.join(ROOT, SMOKE_CONFIG))
    base, pip_source = images.source(t, offline=True)
    images.build(t.image_tag, base, pip_source)
    return t.image_tag
