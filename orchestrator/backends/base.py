"""What a target gives: typed building blocks (`Backend`), after torchx's Scheduler.

A target (compose, swarm, kubernetes) renders a topology to its document and names the
doctor's checks and the host facts only it needs. A target the orchestrator runs adds the
blocks: `deploy` (start the document with the run's variables), `describe` (one
`ServiceState` per service), `log_iter` (the services' log lines, following or not),
`remove`, `read_records` (the app's metrics files), `running_env` (the run going on), and
where it can `scale_to` (and `discard_created`), `serve_board` and `signal_app` (chaos's faults). Every user-facing verb
(up, down, logs, status, smoke, scale, tensorboard) is written once on top of them
(orchestrator/verbs/cluster.py), with one run-record store (orchestrator/backends/record.py);
the CLI builds the verbs of every target in the registry (orchestrator/backends/registry.py)
and never names one.

Methods here import nothing heavy: a backend imports the Docker SDK when a block runs, so
`render` and `doctor --target kubernetes` run without it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Protocol, TextIO

from orchestrator import paths
from orchestrator.doctor.checks import CheckFn
from orchestrator.doctor.facts import Facts
from orchestrator.errors import UsageError
from orchestrator.render.compose import security_warnings
from orchestrator.topology.model import Topology
from orchestrator.topology.services import Service

ENDED = ("exited", "dead")  # a service's states after which it runs no more (unless restarted)


@dataclass(frozen=True)
class ServiceState:
    """One service of a cluster as its target sees it now.

    `status`: the container's state (running, restarting, exited, dead, created, paused),
    `exited` for a task that ended, or what the target says when there is none (`missing`);
    `exit_code` once ended; `restarts`: restarts (compose) or failed tasks before the newest
    (swarm); `task`: swarm's newest task state; `spec`: what the service is, when known."""

    service: str
    status: str
    exit_code: Optional[int] = None
    restarts: int = 0
    health: Optional[str] = None
    task: Optional[str] = None
    error: str = ""
    spec: Optional[Service] = None

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def running(self) -> bool:
        return self.status == "running"

    def with_spec(self, spec: Optional[Service]) -> ServiceState:
        return self if spec is None or self.spec is not None else replace(self, spec=spec)


@dataclass(frozen=True)
class Cluster:
    """The cluster a verb acts on: its name (project, stack), its rendered document, and how
    it was given: `topology` when named on the command line (else it is the one recorded
    by the last up, and its services are read from `file`)."""

    name: str
    file: Path
    config: Optional[str] = None
    workers: Optional[int] = None
    strategy: Optional[str] = None
    topology: Optional[Topology] = None
    overrides: tuple[str, ...] = ()  # the KEY=VALUE its up was given (recorded), for a topology read again
    files: tuple[Path, ...] = ()  # compose files merged over `file` (`up -f`: compose's own override files)


@dataclass(frozen=True)
class LogOptions:
    """`logs --timestamps/--tail N/--since X`, as `docker compose logs` and `docker service
    logs` take them (their words, passed on): `tail` a count or `all`, `since` a timestamp or a
    duration back from now (`42m`)."""

    timestamps: bool = False
    tail: Optional[str] = None
    since: Optional[str] = None

    def flags(self) -> list[str]:
        """The flags both commands take, in their spelling."""
        return (
            (["--timestamps"] if self.timestamps else [])
            + (["--tail", self.tail] if self.tail is not None else [])
            + (["--since", self.since] if self.since is not None else [])
        )


EVERY_LINE = LogOptions()  # logs without a flag: every line, no timestamps


class LogLines(Protocol):
    """What `log_iter` returns: lines (each with its newline), and `close()`, which ends the
    reading from another thread (a follow that has nothing more to wait for)."""

    def __iter__(self) -> Iterator[str]: ...

    def close(self) -> None: ...


class Backend:
    """One target. Class attributes describe it; the CLI builds its verbs from them."""

    name: str = ""
    output: str = ""  # the file `render --target NAME` writes by default (and runs/<name>/ holds)
    noun: str = ""  # what the rendered document starts: project, stack, job
    summary: str = ""  # one line for `render --target`'s help
    verb_prefix: Optional[str] = None  # verbs as PREFIX + up...; None: the orchestrator runs none
    engine: bool = True  # a local Docker engine: doctor asks it, up and smoke build the image there
    smoke_timeout: int = 900  # seconds, the smoke verb's default
    verb_help: dict[str, str] = {}
    refusals: dict[str, str] = {}  # verb -> the one line that refuses it (a verb the target cannot do yet)
    record: str = ""  # the file under runs/ that remembers the last up
    unit: str = "container"  # what runs a service: container, task
    missing: str = "no container"  # a configured service's status when nothing of it is found
    task_table: bool = False  # status prints tasks (state, exit, retries, error), not the metrics columns
    keeps_document: bool = False  # every command of the target reads the document: keep it rendered
    removed: str = "stopped and removed"  # what down did, after "<noun> <name>"
    volume_where: str = ""  # where the state volume stays after down
    ended_well: str = "exited 0"  # what smoke says of each service of a run that passed
    image_note: str = ""  # up's words after "image TAG present"
    merges_files: bool = False  # takes override files merged over its document (`-f`: compose's own)

    # --- the document -------------------------------------------------------
    def render(self, t: Topology, data_root: str) -> str:
        """The target's document for `t` as text; `data_root` makes a relative
        train.data_dir absolute where the target needs host paths."""
        raise NotImplementedError

    def name_of(self, t: Topology) -> str:
        """The name the document gives the cluster (project, stack, job prefix)."""
        raise NotImplementedError

    def document(self, t: Topology, facts: Optional[Facts] = None) -> str:
        """What up and smoke deploy (the doctor's `facts` when it ran): the render, with this
        repository as the root of relative paths."""
        return self.render(t, str(paths.ROOT))

    def warnings(self, t: Topology) -> list[str]:
        """Risky settings the topology asks for, one line each (render prints them)."""
        return security_warnings(t)

    def path_of(self, name: str) -> Path:
        """Where up writes the document of cluster `name`."""
        return paths.RUNS / name / self.output

    # --- doctor: the module beside the backend (CHECKS, gather_facts) ----------
    doctor: Optional[ModuleType] = None

    def checks(self) -> list[CheckFn]:
        """The doctor's checks for this target, in the order they print."""
        if self.doctor is None:
            raise NotImplementedError(f"target {self.name}: no doctor module")
        return list(self.doctor.CHECKS)

    def gather_facts(self, t: Topology, client: Any, facts: Facts, probe: bool) -> dict[str, Any]:
        """Facts only this target needs, as Facts fields (its own under `target`)."""
        return {} if self.doctor is None else dict(self.doctor.gather_facts(t, client, facts, probe))

    # --- the blocks of a target the orchestrator runs ---------------------------
    def deploy(self, c: Cluster, env: dict[str, str], out: TextIO) -> list[str]:
        """Start (or update) the cluster from `c.file` with `env` (the run's variables); the
        problems the target reported without failing (options it ignored)."""
        raise self._not_run("up")

    def describe(self, c: Cluster) -> list[ServiceState]:
        """Every service of the cluster found on the target, one state each."""
        raise self._not_run("status")

    def log_iter(self, c: Cluster, follow: bool, options: LogOptions = EVERY_LINE) -> LogLines:
        """Every service's log lines, prefixed by service; following: until closed or the target
        ends them; `options`: timestamps, the last lines only, the lines since a time."""
        raise self._not_run("logs")

    def remove(self, c: Cluster, volumes: bool) -> None:
        """Stop and remove the cluster (and its volume with `volumes`); return once it is gone."""
        raise self._not_run("down")

    def read_records(self, c: Cluster, service: str) -> dict[str, list[str]]:
        """{file name: lines} of the metrics files `service` sees (the state volume)."""
        return {}

    def read_kept(self, c: Cluster) -> Optional[bytes]:
        """A tar of the directory of what MLflow had not taken at the ends of the cluster's runs
        (the state volume's metrics/mlflow-pending/); None where the target cannot read it."""
        return None

    def drop_kept(self, c: Cluster, run_id: str) -> None:
        """Remove run `run_id`'s kept MLflow records from the state volume, once sent."""
        raise self._not_run("runs sync")

    def remove_state(self, name: str) -> None:
        """Remove the state volume of cluster `name`, of which nothing else is left."""
        raise self._not_run("runs rm")

    def known_clusters(self) -> list[str]:
        """The names of the clusters whose state the target keeps (a state volume), whatever
        the records under runs/ say; [] where the target cannot tell cheaply."""
        return []

    def running_env(self, c: Cluster, names: Sequence[str]) -> dict[str, str]:
        """The variables `names` of the run going on ({} when none runs)."""
        return {}

    def scale_to(self, c: Cluster, start: Sequence[str], stop: Sequence[str], env: dict[str, str]) -> None:
        """Start the services `start` (with `env`) and stop `stop` (SIGTERM: a clean leave)."""
        raise self._not_run("scale")

    def discard_created(self, c: Cluster, services: Sequence[str]) -> list[str]:
        """Remove what of `services` was made but never started (a `scale_to` cut short by the
        run's end); the names removed."""
        return []

    def signal_app(self, c: Cluster, service: str, signal_name: str) -> float:
        """Send `signal_name` (SIGKILL, SIGSTOP, SIGCONT) to the app process of `service`, as the
        kernel's OOM killer or a segfault would: the target's restart policy applies. The unix
        time just before (what it sets off may be recorded before this returns)."""
        raise self._not_run("signal")

    def export_model(self, c: Cluster, run_id: str, into: Path) -> None:
        """Write run `run_id`'s model.pt and model.json into `into` from the cluster's state
        (the app's export role, app/export.py)."""
        raise self._not_run("export")

    def serve_board(self, c: Cluster, env: dict[str, str]) -> str:
        """Start TensorBoard on the cluster's event files with `env` (its run and port); the
        command that shows its log when it does not answer."""
        raise self._not_run("tensorboard")

    def verb(self, name: str) -> str:
        """The target's verb `name` (up, down, ...) as the CLI and make spell it: prefix and name."""
        return (self.verb_prefix or "") + name

    def check_files(self, c: Cluster) -> None:
        """UsageError (one line) unless the target merges `c.files` over its document: only
        compose takes override files."""
        if c.files:
            raise UsageError(
                f"-f: target {self.name} takes no override file (compose's own, merged by `docker compose -f`); "
                "drop -f, or run on compose"
            )

    def refuse(self, verb: str) -> None:
        """UsageError with the target's one line when it cannot do `verb` yet."""
        if verb in self.refusals:
            raise UsageError(self.refusals[verb])

    def _not_run(self, verb: str) -> UsageError:
        return UsageError(f"target {self.name} has no {verb} verb: render it and use its own tools")
