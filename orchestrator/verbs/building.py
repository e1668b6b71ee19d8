"""The app's image of a topology: `build` (the verb), and what `up` makes sure of before it
starts anything (`ensure_image`): the image built when missing or when its packages layer is
not the topology's (orchestrator.user_packages), and the MLflow server's image where the
topology has its own server."""

from __future__ import annotations

import sys
from typing import Any, Optional, TextIO

from orchestrator import images, tracking_image, user_packages
from orchestrator.backends.base import Backend
from orchestrator.errors import engine_errors
from orchestrator.render import tracking
from orchestrator.topology.model import Topology, load_with


def ensure_image(backend: Backend, client: Any, t: Topology, offline: bool, out: TextIO) -> dict[str, str]:
    """The app's image, built when missing or when its packages layer is not the topology's
    (image.packages); the MLflow server's too where the topology has one. The versions of the
    topology's packages in it."""
    if not backend.engine:
        return {}
    base, pip_source = images.source(t, offline)
    lines = user_packages.requirement_lines(t)
    labels = user_packages.image_labels(client, t.image_tag)
    if user_packages.is_current(labels, lines):
        print(f"==> image {t.image_tag} present {backend.image_note}", file=out, flush=True)
    else:
        labels = build_image(client, t, base, pip_source, lines, out)
    if tracking.tracked_by_own_server(t):
        tracking_image.ensure(client, base, pip_source, out)
    return user_packages.installed_in(labels)


def build_image(
    client: Any, t: Topology, base: str, pip_source: str, lines: list[str], out: TextIO, verbose: bool = False
) -> dict[str, str]:
    """The app's image of `t`, with the layer of its packages over it when it has some; its labels."""
    images.build(t.image_tag, base, pip_source, out=out, verbose=verbose)
    if lines:
        user_packages.build_layer(client, t.image_tag, lines, pip_source, out)
    return user_packages.image_labels(client, t.image_tag) or {}


@engine_errors
def build(
    config: str,
    workers: Optional[int] = None,
    *,
    offline: bool = False,
    verbose: bool = False,
    overrides: tuple[str, ...] = (),
) -> int:
    """(Re)build the topology's image (and its MLflow server's, where it has one)."""
    t = load_with(config, workers=workers, overrides=overrides)
    base, pip_source = images.source(t, offline)
    lines = user_packages.requirement_lines(t)
    labels = build_image(images.client(), t, base, pip_source, lines, sys.stdout, verbose)
    installed = user_packages.installed_in(labels)
    if installed:
        print(f"==> image.packages: {user_packages.described(installed)}", flush=True)
    if tracking.tracked_by_own_server(t):
        tracking_image.build(base, pip_source)
    return 0
