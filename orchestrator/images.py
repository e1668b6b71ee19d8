"""Image builds with the Docker SDK for Python, progress printed as it streams.

Two paths (images/Dockerfile), each keeping its base's torch + torchvision:
- default: FROM the topology's `image.base` (an official PyTorch image, from a
  registry, with its own pair), the rest from PyPI;
- offline: FROM `ps-compose-base:bookworm` (images/build-offline-base.sh:
  debootstrap, the pair of images/torch-pair.txt, docker import; no registry)
  with the rest from images/wheelhouse/ (images/wheelhouse.sh) and
  `pip install --no-index`.
A topology picks its path with `image.base` and `image.pip_source`;
`source(t, offline=True)` forces the offline one (`make smoke`, CI).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, TextIO

import docker
import docker.errors

from orchestrator.errors import EngineError, daemon_reason
from orchestrator.paths import DOCKERFILE, HOME

OFFLINE_BASE = "ps-compose-base:bookworm"
# The base of an image that needs a Python and no torch (the MLflow server's): the offline base's
# tree before the torch pair (made with it), or online the official Python image of its Debian
# and Python.
OFFLINE_PYTHON = "ps-compose-python:bookworm"
ONLINE_PYTHON = "python:3.11-slim-bookworm"
BASE_SCRIPT = HOME / "images" / "build-offline-base.sh"
WHEELHOUSE_SCRIPT = HOME / "images" / "wheelhouse.sh"


def client(timeout: int = 600) -> docker.DockerClient:
    """A client of a daemon that answers; EngineError with what to do if none does."""
    where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        c = docker.from_env(timeout=timeout)
        c.ping()
    except docker.errors.DockerException as e:
        reason = daemon_reason(e)
        if reason == "permission denied":
            reason += ": add yourself to the docker group or use sudo"
        raise EngineError(
            f"cannot reach the Docker daemon at {where} ({reason}); "
            "start it (`sudo dockerd &`, `sudo systemctl start docker`) or run `make engine`"
        ) from None
    return c


def image_exists(c: docker.DockerClient, tag: str) -> bool:
    try:
        c.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def prepare(base: str, pip_source: str, out: TextIO = sys.stdout) -> None:
    """What the offline path needs before a build: the base image (when it is the
    offline base) and the wheelhouse (for `wheelhouse`), each made only when
    missing or stale, each step timed."""
    if base == OFFLINE_BASE:
        run_step("base image", BASE_SCRIPT, out)
    if pip_source == "wheelhouse":
        run_step("wheelhouse", WHEELHOUSE_SCRIPT, out)


def run_step(what: str, script: Path, out: TextIO, env: Optional[Mapping[str, str]] = None) -> None:
    """One step of the offline path: `script` (it does nothing when its result is up to date),
    with `env` added to this process's environment; timed, EngineError when it fails."""
    start = time.monotonic()
    print(f"==> offline {what}: {script.relative_to(HOME)}", file=out, flush=True)
    argv = [str(script)]
    if script == BASE_SCRIPT and os.geteuid() != 0 and not _base_present():
        argv = ["sudo", *argv]  # debootstrap and chroot need root
    r = subprocess.run(argv, cwd=HOME, env=None if env is None else {**os.environ, **env})
    if r.returncode != 0:
        raise EngineError(f"{script.relative_to(HOME)} ({what}) failed with exit status {r.returncode}")
    print(f"    {what} ready in {time.monotonic() - start:.0f} s", file=out, flush=True)


def _base_present() -> bool:
    inspect = ["docker", "image", "inspect", OFFLINE_BASE, OFFLINE_PYTHON]
    return subprocess.run(inspect, capture_output=True).returncode == 0


def python_base(base: str) -> str:
    """The torch-free base beside the app's `base`: the offline one's Python, else the official Python image."""
    return OFFLINE_PYTHON if base == OFFLINE_BASE else ONLINE_PYTHON


def source(t: Any, offline: bool = False) -> tuple[str, str]:
    """(BASE_IMAGE, PIP_SOURCE) for topology `t`; `offline` forces the offline path."""
    if offline:
        return OFFLINE_BASE, "wheelhouse"
    pip_source = getattr(t.image, "pip_source", None) or ("wheelhouse" if t.image.base == OFFLINE_BASE else "index")
    return t.image.base, pip_source


def build(
    tag: str,
    base: str,
    pip_source: str = "index",
    *,
    out: TextIO = sys.stdout,
    verbose: bool = False,
) -> str:
    """Build `tag` from images/Dockerfile FROM `base`, pip packages from `pip_source`
    (`index` or `wheelhouse`); returns the image id. Step lines are printed as
    the daemon streams them (every output line with `verbose`)."""
    check_pip_source(pip_source)
    c = client()
    prepare(base, pip_source, out)
    return stream_build(c, tag, base, pip_source, out, verbose=verbose, path=str(HOME), dockerfile=DOCKERFILE)


def check_pip_source(pip_source: str) -> None:
    if pip_source not in ("index", "wheelhouse"):
        raise EngineError(f"pip source {pip_source!r}: must be index or wheelhouse")


def stream_build(
    c: docker.DockerClient,
    tag: str,
    base: str,
    pip_source: str,
    out: TextIO,
    *,
    verbose: bool = False,
    what: str = "",
    **context: Any,
) -> str:
    """`docker build` of `tag` with the build arguments BASE_IMAGE and PIP_SOURCE, from `context`
    (the Docker SDK's: `path` and `dockerfile`, or a tar as `fileobj` with `custom_context`, and
    `labels`), its progress printed (follow_build) and timed; the image id. `what`: the image's
    purpose, for the first line."""
    print(f"==> building {tag} FROM {base} ({what}pip packages from: {pip_source})", file=out, flush=True)
    start = time.monotonic()
    stream = c.api.build(
        tag=tag,
        buildargs={"BASE_IMAGE": base, "PIP_SOURCE": pip_source},
        decode=True,
        rm=True,
        forcerm=True,
        pull=False,
        **context,
    )
    image_id = follow_build(stream, out, verbose=verbose)
    print(f"    built {tag} ({image_id[:19]}) in {time.monotonic() - start:.0f} s", file=out, flush=True)
    return image_id


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def follow_build(stream: Iterable[dict[str, Any]], out: TextIO, *, verbose: bool = False) -> str:
    """Print a build's progress; the image id, or EngineError with the failing step's output."""
    image_id = ""
    recent: list[str] = []  # output of the current step, shown if it fails
    for chunk in stream:
        if "error" in chunk or "errorDetail" in chunk:
            message = chunk.get("error") or chunk["errorDetail"].get("message", "")
            # A step that explains itself (`error: ...`, as the Dockerfile's checks do) is the message.
            plain = [_ANSI.sub("", line).strip() for line in recent]  # stderr comes coloured
            said = [line[len("error: ") :] for line in plain if line.startswith("error: ")]
            tail = "".join(f"    | {line}\n" for line in recent[-30:])
            raise EngineError(
                f"image build failed: {said[-1] if said else message.strip()}" + (f"\n{tail}" if tail else "")
            )
        aux = chunk.get("aux") or {}
        if "ID" in aux:
            image_id = aux["ID"]
        text = chunk.get("stream")
        if not text:
            continue
        for line in text.splitlines():
            if line.startswith("Step "):
                recent = []
                step = line if verbose or len(line) <= 120 else line[:117] + "..."
                print(f"    {step}", file=out, flush=True)
            elif line.strip():
                recent.append(line)
                shown = _ANSI.sub("", line)
                if verbose or shown.startswith("warning: "):  # a build's warning is for the user
                    print(f"      {line if verbose else shown}", file=out, flush=True)
    if not image_id:
        raise EngineError("image build ended without an image id")
    return image_id
