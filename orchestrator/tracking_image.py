"""The image of the project's own MLflow tracking server (`tracking.mlflow: true`):
images/tracking.Dockerfile FROM a Python without torch (`images.python_base`: the offline base's
Python, or the official Python image), with the lock requirements/tracking-server.txt.

Its build context is a tar made here (the Dockerfile, the lock, images/requirements.py and, offline,
the wheels of images/wheelhouse-tracking/), so the app's builds never send those wheels. The
image carries a label with a key of what it was built from (the Dockerfile, the lock, the base and
the pip source): `ensure` builds it when it is missing or its key is not today's.
"""

from __future__ import annotations

import hashlib
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, TextIO

import docker.errors

from orchestrator import images
from orchestrator.paths import HOME
from orchestrator.render.tracking import MLFLOW_IMAGE

DOCKERFILE = HOME / "images" / "tracking.Dockerfile"
LOCK = HOME / "requirements" / "tracking-server.txt"
REQUIREMENTS_PY = HOME / "images" / "requirements.py"
WHEELHOUSE = HOME / "images" / "wheelhouse-tracking"
KEY_LABEL = "ps-compose.tracking-key"


def key(base: str, pip_source: str) -> str:
    """16 hex digits of what the image is built from."""
    h = hashlib.sha256()
    for part in (DOCKERFILE.read_bytes(), LOCK.read_bytes(), REQUIREMENTS_PY.read_bytes()):
        h.update(hashlib.sha256(part).digest())
    h.update(f"{base}\n{pip_source}".encode())
    return h.hexdigest()[:16]


def ensure(client: Any, base: str, pip_source: str, out: TextIO = sys.stdout) -> None:
    """The tracking server's image beside the app's `base`, built unless one of today's key is there."""
    want = key(images.python_base(base), pip_source)
    try:
        have = (client.images.get(MLFLOW_IMAGE).labels or {}).get(KEY_LABEL)
    except docker.errors.ImageNotFound:
        have = None
    if have == want:
        print(f"==> image {MLFLOW_IMAGE} present (MLflow tracking server)", file=out, flush=True)
        return
    if have is not None:
        print(f"==> image {MLFLOW_IMAGE} was built from another lock, Dockerfile or base: rebuilding it", file=out)
    build(base, pip_source, out=out)


def build(base: str, pip_source: str, *, out: TextIO = sys.stdout) -> str:
    """Build MLFLOW_IMAGE FROM the Python beside the app's `base`, its packages from PyPI (`index`)
    or the wheelhouse; its id."""
    images.check_pip_source(pip_source)
    c = images.client()
    images.prepare(base, "index", out)  # the offline base and its Python, when it is the base
    base = images.python_base(base)
    if pip_source == "wheelhouse":
        fill_wheelhouse(out)
    with tempfile.TemporaryFile() as context:
        write_context(context, with_wheels=pip_source == "wheelhouse")
        context.seek(0)
        return images.stream_build(
            c,
            MLFLOW_IMAGE,
            base,
            pip_source,
            out,
            what="MLflow tracking server; ",
            fileobj=context,
            custom_context=True,
            dockerfile="Dockerfile",
            labels={KEY_LABEL: key(base, pip_source)},
        )


def fill_wheelhouse(out: TextIO) -> None:
    """images/wheelhouse-tracking/ from the lock (images/wheelhouse.sh: skipped when up to date)."""
    where = str(WHEELHOUSE.relative_to(HOME))
    # Every package of the lock: its base is a Python without torch, which has none of them.
    wanted = {"LOCK": str(LOCK), "OUT": str(WHEELHOUSE), "WITHOUT": ""}
    images.run_step(f"wheelhouse {where}", images.WHEELHOUSE_SCRIPT, out, wanted)


def write_context(fileobj: Any, *, with_wheels: bool) -> None:
    """The build context as a tar: Dockerfile, build/{tracking-server.txt, requirements.py, wheels/}."""
    with tarfile.open(fileobj=fileobj, mode="w") as tar:
        tar.add(DOCKERFILE, arcname="Dockerfile")
        tar.add(LOCK, arcname="build/tracking-server.txt")
        tar.add(REQUIREMENTS_PY, arcname="build/requirements.py")
        if with_wheels:
            for wheel in sorted(Path(WHEELHOUSE).glob("*.whl")):
                tar.add(wheel, arcname=f"build/wheels/{wheel.name}")
