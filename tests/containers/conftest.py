"""Fixtures of the container tests.

`engine`: a Docker client of a daemon that answers. When none answers, a test
that needs it FAILS under CI=true (`.ci/run` sets it: the container tests must
never skip there) and is skipped elsewhere (a laptop without Docker).
"""

import os

import pytest

from needs import unavailable

SMOKE_CONFIG = "configs/cpu-smoke.yaml"


@pytest.fixture(scope="session")
def engine():
    from orchestrator import images
    from orchestrator.errors import EngineError

    try:
        return images.client(timeout=600)
    except EngineError as e:
        unavailable(f"no Docker engine answers: {e}")


@pytest.fixture(scope="session")
def offline_image(engine):
    """The cpu-smoke image, built once per session on the offline path (fast when cached),
    so a warm machine never runs an image of older app code. One build at a time on this
    host: `make test`'s workers (tests/conftest.py) each have a session, and the second
    finds every layer the first built."""
    import fcntl

    from orchestrator import images
    from orchestrator.paths import ROOT
    from orchestrator.topology.model import load

    t = load(os.path.join(ROOT, SMOKE_CONFIG))
    base, pip_source = images.source(t, offline=True)
    os.makedirs(os.path.join(ROOT, "images", ".cache"), exist_ok=True)
    with open(os.path.join(ROOT, "images", ".cache", "offline-image.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        images.build(t.image_tag, base, pip_source)
    return t.image_tag


NODES_SCRIPT = os.path.join(os.path.dirname(__file__), "swarm_nodes.sh")


def _nodes_script(*args: str, timeout: float) -> None:
    import subprocess
    import time

    start = time.monotonic()
    r = subprocess.run(["bash", NODES_SCRIPT, *args], capture_output=True, text=True, timeout=timeout)
    print(r.stdout + r.stderr, end="")
    print(f"swarm-nodes: `{' '.join(args[:1])}` took {time.monotonic() - start:.1f} s")
    if r.returncode != 0:
        pytest.fail(
            f"swarm_nodes.sh {' '.join(args)} failed (status {r.returncode}): {r.stderr.strip()[-2000:]}", pytrace=False
        )


@pytest.fixture(scope="module")
def two_nodes(offline_image):
    """A two-node swarm on this host (tests/containers/swarm_nodes.sh): psc-n1 (manager,
    unix:///var/run/docker-n1.sock) and psc-n2, each a dockerd in a network namespace of its
    own, the offline image on both; the image's tag. Torn down after the module, even after a
    failed test or setup. DOCKER_HOST is left alone (the other tests use this host's engine).
    It needs root, iproute2, util-linux and dockerd: without them it fails under CI=true,
    else skips."""
    import shutil

    # swarm_nodes.sh adds the sbin directories to its PATH, so they are searched here too.
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
    missing = [c for c in ("ip", "nsenter", "unshare", "dockerd") if shutil.which(c, path=path) is None]
    why = "needs root" if os.geteuid() != 0 else f"missing {', '.join(missing)}" if missing else None
    if why:
        unavailable(f"the two-node swarm cannot be made: {why}")
    try:
        _nodes_script("up", offline_image, timeout=1200)
        yield offline_image
    finally:
        _nodes_script("down", timeout=300)
