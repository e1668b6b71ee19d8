"""The export block of the targets that keep a run's state in a Docker volume (compose, swarm):
`python -m app export` in a one-off container made like the run's PS (allreduce: worker1),
with its image, environment, volumes and user as the rendered document gives them, on no
network. It writes into its own file system; the two files come out of the container as a tar
and replace the export directory whole (app.publish).

On a swarm of several nodes the volume is the PS node's: run the export there."""

from __future__ import annotations

import contextlib
import io
import re
import signal
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from app.publish import publish
from orchestrator.errors import UsageError
from orchestrator.job_secret import SECRET_ENV, SOCKET_DIR_ENV
from orchestrator.render.compose import EXCHANGE_VOLUME
from orchestrator.topology.services import PS_SERVICE, SCRATCH_LABEL

# Where the container writes model.pt and model.json: its own file system, not the state
# volume, so two exports of one name at once each get their own run, and none leaves files there.
EXPORT_IN_CONTAINER = "/tmp/export"
FILES = ("model.pt", "model.json")
WAIT_SECONDS = 600
INTERPOLATED = re.compile(r"^\$\{[A-Z0-9_]+:-\}$")  # a variable the engine fills at deploy time
_COMPOSE_VALUE = re.compile(r"\$\$|\$\{[A-Za-z0-9_]+(?::?-([^}]*))?\}")


def as_compose_reads(value: str) -> str:
    """A value of the rendered document as compose gives it to a container with none of its
    variables set: `$$` is `$`, `${VAR:-default}` its default (the render writes no other form)."""
    return _COMPOSE_VALUE.sub(lambda m: "$" if m.group(0) == "$$" else (m.group(1) or ""), value)


def exporting_service(document: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The service whose container holds the run's checkpoints: the PS, else (allreduce) worker1."""
    services = document.get("services") or {}
    for name in (PS_SERVICE, "worker1"):
        if isinstance(services.get(name), dict):
            return name, services[name]
    raise UsageError("the rendered document has neither a ps nor a worker1 service: nothing holds the run's state")


def environment(service: dict[str, Any], run_id: str, export_dir: str) -> dict[str, str]:
    """The service's environment (a mapping or KEY=VALUE list) for the export: the run's id in
    place of the deploy-time variables, and where to write."""
    raw = service.get("environment") or {}
    pairs = raw.items() if isinstance(raw, dict) else (item.split("=", 1) for item in raw if "=" in item)
    # A null value (a variable compose takes from its caller: credentials) is not the export's.
    env = {str(k): as_compose_reads(str(v)) for k, v in pairs if v is not None and not INTERPOLATED.match(str(v))}
    env.update(PSC_RUN_ID=run_id, PSC_EXPORT_DIR=export_dir)
    for joins_no_job in (SECRET_ENV, SOCKET_DIR_ENV):
        env.pop(joins_no_job, None)
    return env


def volumes(service: dict[str, Any], prefix: str, directory: Path) -> dict[str, dict[str, str]]:
    """The service's volumes as the Docker SDK takes them: a named volume under its project's
    (stack's) name `prefix`; a bind mount's source as compose resolves it, an absolute path
    (a relative one under the project's `directory`, `~` the user's home)."""
    out: dict[str, dict[str, str]] = {}
    for entry in service.get("volumes") or []:
        if isinstance(entry, str):
            parts = entry.split(":")
            source, target = parts[0], parts[1]
            mode = "ro" if len(parts) > 2 and "ro" in parts[2].split(",") else "rw"
            kind = "bind" if source.startswith(("/", ".", "~")) else "volume"
        else:
            source, target = str(entry.get("source", "")), str(entry["target"])
            mode = "ro" if entry.get("read_only") else "rw"
            kind = str(entry.get("type", "volume"))
        if kind == "volume" and source == EXCHANGE_VOLUME:
            continue  # the job's sockets and secret: the export joins no job
        if kind == "volume":
            source = f"{prefix}_{source}"
        else:
            source = str(directory / Path(as_compose_reads(source)).expanduser())
        out[source] = {"bind": target, "mode": mode}
    return out


def export(client: Any, document_file: Path, prefix: str, run_id: str, into: Path, directory: Path) -> Path:
    """Run the export of `run_id` ('' : the newest run) from the state of cluster `prefix`, whose
    rendered document is `document_file` (its relative paths under `directory`); model.pt and
    model.json written to `into`."""
    document = yaml.safe_load(document_file.read_text(encoding="utf-8")) or {}
    name, service = exporting_service(document)
    with _sigterm_as_exit():
        return _run(client, name, service, prefix, run_id, into, directory)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM as SystemExit(143) while the export runs (main thread only), so its container is
    removed on the way out, not left running with the state volume held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(
    client: Any, name: str, service: dict[str, Any], prefix: str, run_id: str, into: Path, directory: Path
) -> Path:
    """The export container run to its end, its two files taken out, and it removed."""
    container = client.containers.run(
        service["image"],
        command=["export"],
        environment=environment(service, run_id, EXPORT_IN_CONTAINER),
        volumes=volumes(service, prefix, directory),
        user=service.get("user"),
        network_mode="none",
        labels={SCRATCH_LABEL: prefix},
        detach=True,
    )
    try:
        code = container.wait(timeout=WAIT_SECONDS).get("StatusCode", 1)
        if code != 0:
            said = container.logs(stdout=True, stderr=True).decode("utf-8", "replace").strip().splitlines()
            raise UsageError(f"export from {name}'s state failed: {said[-1] if said else f'exit status {code}'}")
        stream, _ = container.get_archive(EXPORT_IN_CONTAINER)
        return extract(b"".join(stream), into)
    finally:
        container.remove(force=True)


def extract(archive: bytes, into: Path) -> Path:
    """model.pt and model.json out of the export directory's tar into `into` (nothing else)."""
    found: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if member.isfile() and name in FILES:
                data = tar.extractfile(member)
                assert data is not None  # a regular file
                found[name] = data.read()
    missing = [f for f in FILES if f not in found]
    if missing:
        raise UsageError(f"the export wrote no {', '.join(missing)}")
    return publish(found, into)
