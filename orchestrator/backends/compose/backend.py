"""The compose target: one host, `docker compose` (render: orchestrator/render/compose.py;
the command line and the SDK reads: backends/compose/adapter.py; the verbs on top of these
blocks: orchestrator/verbs/cluster.py)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, TextIO

import yaml

from app.contract import MLFLOW_PENDING_DIR
from orchestrator import images
from orchestrator.backends import command, export_container
from orchestrator.backends.base import EVERY_LINE, Backend, Cluster, LogLines, LogOptions, ServiceState
from orchestrator.backends.compose import adapter, app_signal, doctor
from orchestrator.backends.compose.status import service_states
from orchestrator.backends.lines import ProcessLines
from orchestrator.errors import EngineError, UsageError, last_line
from orchestrator.paths import ROOT
from orchestrator.render import compose
from orchestrator.topology.model import Topology

KEPT_DIR = f"{compose.METRICS_DIR}/{MLFLOW_PENDING_DIR}"  # what MLflow had not taken (app.training.tracking_pending)

# `scale` down: a worker's SIGTERM is a clean leave (its push answered, the PS told); compose
# kills it after this many seconds (its own SIGTERM grace is at most 5 s).
SCALE_STOP_SECONDS = 20


@functools.lru_cache(maxsize=1)
def _compose() -> adapter.Compose:
    return adapter.detect()


def project(c: Cluster) -> adapter.Project:
    return adapter.Project(c.name, str(c.file), str(ROOT), tuple(str(f) for f in c.files))


class ComposeBackend(Backend):
    name = "compose"
    output = "compose.yaml"
    doctor = doctor
    noun = "project"
    summary = "compose (docker compose, one host)"
    verb_prefix = ""
    smoke_timeout = 900
    record = "current.json"
    keeps_document = True
    merges_files = True
    image_note = "(build rebuilds it)"
    verb_help = {
        "up": "render if needed, build if the image is missing, start detached",
        "down": "stop and remove the cluster (the volume with checkpoints and metrics stays)",
        "logs": "follow every service's log, prefixed by service, until every container has exited",
        "status": "one line per service: state, exit code, last step, loss",
        "smoke": "the CPU cluster end to end in containers; checks accuracy and exit codes",
        "scale": "grow or shrink the running cluster to --workers N (up to workers.max) without stopping it",
        "tensorboard": "TensorBoard on every run's event files (or --run ID's), at http://127.0.0.1:PORT/",
        "export": "the run's trained model (--run ID: an earlier run's) to runs/NAME/model/: model.pt, model.json",
    }

    def render(self, t: Topology, data_root: str) -> str:
        return compose.dump(compose.render(t), t.name, t.overrides)

    def name_of(self, t: Topology) -> str:
        return compose.project_name(t)

    def deploy(self, c: Cluster, env: dict[str, str], out: TextIO) -> list[str]:
        print(f"==> starting with {_compose()}", file=out, flush=True)
        try:
            command.run(adapter.up_argv(_compose(), project(c)), env=env)
        except EngineError:
            said = adapter.mistakes(images.client(), c.name)
            if said:  # a process stopped on a mistake of the run's (app/stops.py): that, not compose's words
                service, line = said[0]
                raise UsageError(
                    f"{service} stopped on a mistake and is not retried: {line}; fix it, then `down` and `up` again"
                ) from None
            raise
        return []

    def signal_app(self, c: Cluster, service: str, signal_name: str) -> float:
        found = {x.labels.get(adapter.LABEL_SERVICE): x for x in adapter.containers(images.client(), c.name)}
        if service not in found:
            raise UsageError(f"{c.name}: no container of service {service!r}")
        return app_signal.send(found[service], signal_name)

    def check_files(self, c: Cluster) -> None:
        """UsageError (one line) when compose cannot merge the override files over the document:
        a file that is missing, not YAML, or whose merge is not a valid project (compose's words)."""
        if c.files:
            r = command.run(adapter.config_argv(_compose(), project(c)), check=False, capture=True)
            if r.returncode != 0:
                raise UsageError(
                    f"-f: compose cannot merge {', '.join(str(f) for f in c.files)} over {c.file.name}: "
                    f"{last_line(r.stderr) or f'exit status {r.returncode}'}"
                )

    def describe(self, c: Cluster) -> list[ServiceState]:
        return service_states([x.attrs for x in adapter.containers(images.client(), c.name)])

    def log_iter(self, c: Cluster, follow: bool, options: LogOptions = EVERY_LINE) -> LogLines:
        found = _compose()
        if options.since is not None and found.version < 2:
            raise UsageError(f"--since: {found} has no --since; drop it, or use compose v2")
        return ProcessLines([adapter.logs_argv(found, project(c), follow=follow, color=False, extra=options.flags())])

    def remove(self, c: Cluster, volumes: bool) -> None:
        adapter.remove_scratch(images.client(), c.name)  # a killed export's container holds the volume
        command.run(adapter.down_argv(_compose(), project(c), volumes=volumes))
        # The private exchange's tmpfs held the run's secret and sockets, gone with its containers:
        # nothing to keep, so `down` takes the empty volume too.
        adapter.discard_volume(images.client(), f"{c.name}_{compose.EXCHANGE_VOLUME}")
        left = adapter.volumes_left(images.client(), c.name) if volumes else []
        if left:  # compose only warns ("Resource is still in use") and exits 0
            raise EngineError(f"down -v: volume {', '.join(left)} still there: a container outside the project uses it")

    def read_records(self, c: Cluster, service: str) -> dict[str, list[str]]:
        client = images.client()
        return adapter.read_metrics(client, c.name, adapter.containers(client, c.name))

    def read_kept(self, c: Cluster) -> Optional[bytes]:
        client = images.client()
        try:
            return adapter.read_volume(client, c.name, adapter.containers(client, c.name), KEPT_DIR)
        except Exception as error:
            if getattr(error, "status_code", None) == 404:  # the engine's NotFound: no run kept anything
                return None
            raise

    def drop_kept(self, c: Cluster, run_id: str) -> None:
        adapter.remove_in_volume(images.client(), c.name, f"{KEPT_DIR}/{run_id}")

    def remove_state(self, name: str) -> None:
        adapter.remove_volume(images.client(), f"{name}_{compose.STATE_VOLUME}")

    def known_clusters(self) -> list[str]:
        return adapter.state_volume_projects(images.client())

    def running_env(self, c: Cluster, names: Sequence[str]) -> dict[str, str]:
        return adapter.running_env(images.client(), c.name, names)

    def scale_to(self, c: Cluster, start: Sequence[str], stop: Sequence[str], env: dict[str, str]) -> None:
        # Captured: a failure is one line (the verb says more when the run ended meanwhile).
        if start:
            command.run(adapter.start_services_argv(_compose(), project(c), start), env=env, capture=True)
        if stop:
            command.run(adapter.stop_argv(_compose(), project(c), stop, SCALE_STOP_SECONDS), capture=True)

    def discard_created(self, c: Cluster, services: Sequence[str]) -> list[str]:
        return adapter.remove_created(images.client(), c.name, services)

    def export_model(self, c: Cluster, run_id: str, into: Path) -> None:
        export_container.export(images.client(), c.file, c.name, run_id, into, ROOT)

    def serve_board(self, c: Cluster, env: dict[str, str]) -> str:
        if not _has_board(c):
            raise UsageError(f"{c.file}: no tensorboard service in it (rendered before there was one): make up renders")
        command.run(adapter.tensorboard_argv(_compose(), project(c)), env=env)
        return f"docker logs {c.name}-{compose.TENSORBOARD_SERVICE}-1"


def _has_board(c: Cluster) -> bool:
    try:
        doc = yaml.safe_load(c.file.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return False
    return compose.TENSORBOARD_SERVICE in (doc.get("services") or {})


BACKEND = ComposeBackend()
