"""A Docker client that answers from recorded `docker inspect` attrs and metrics files:
what `status` and `tensorboard` read from an engine, without one (the reads are the SDK's
`containers.list`, `get_archive` and `images.get`; everything else is the real code)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import docker.errors

RECORDED = Path(__file__).resolve().parents[1] / "containers" / "recorded"


def recorded(name: str) -> list[dict[str, Any]]:
    return json.loads((RECORDED / name).read_text())


def metrics_tar(files: dict[str, list[str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, lines in files.items():
            data = "\n".join(lines).encode()
            info = tarfile.TarInfo(f"metrics/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Container:
    def __init__(self, attrs: dict[str, Any], metrics: dict[str, list[str]]) -> None:
        self.attrs, self._metrics = attrs, metrics
        self.labels = (attrs.get("Config") or {}).get("Labels") or {}
        self.name = (attrs.get("Name") or "?").lstrip("/")

    def get_archive(self, path: str) -> tuple[list[bytes], dict[str, Any]]:
        return [metrics_tar(self._metrics)], {}

    def reload(self) -> None:
        pass


class _Containers:
    def __init__(self, engine: RecordedEngine) -> None:
        self.engine = engine

    def list(  # noqa: A002 - the SDK's names
        self, all: bool = False, filters: Any = None, ignore_removed: bool = False
    ) -> list[Container]:
        return [Container(a, self.engine.metrics) for a in self.engine.attrs]


class _Images:
    def __init__(self, engine: RecordedEngine) -> None:
        self.engine = engine

    def get(self, tag: str) -> Any:
        if tag not in self.engine.tags:
            raise docker.errors.ImageNotFound(f"No such image: {tag}")
        return tag

    def list(self, filters: Any = None) -> list[Any]:
        return []


class RecordedEngine:
    """`containers`: their inspect attrs; `metrics`: {file: lines} every container's /state/metrics holds;
    `images`: the tags present."""

    def __init__(
        self, containers: list[dict[str, Any]], metrics: dict[str, list[str]], images: tuple[str, ...] = ()
    ) -> None:
        self.attrs, self.metrics, self.tags = containers, metrics, set(images)
        self.containers, self.images = _Containers(self), _Images(self)
