"""The soak's compose project: the chaos topology on a size-limited state volume, and what
the soak does to it and reads from it through the engine.

The state volume is a tmpfs of a fixed size (so that it can be filled). Docker mounts such a
volume when a first container uses it and unmounts it, contents and all, when the last one
stops; a keeper container (not of the project: it mounts the volume and sleeps) holds it
mounted from `up` until the soak has read what it needs at the end. The soak's own writes
(filling the volume, damaging a checkpoint) and reads (the PS's records, the checkpoint
files and their checksums) go through the keeper, as uid 1000 like the app, never through
a container of the job.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any, Optional

from orchestrator.chaos import soak_probes
from orchestrator.chaos.containers import ContainerJob
from orchestrator.chaos.soak_checks import Audit, Shm
from orchestrator.metrics.records import Record, metrics_from_tar, parse_lines
from orchestrator.render import compose
from orchestrator.render.compose import CHECKPOINT_DIR, LABEL_ROLE, METRICS_DIR, STATE_DIR, STATE_VOLUME
from orchestrator.render.yamlio import write_atomic
from orchestrator.topology.model import Topology

KEEPER_LABEL = "ps-compose.soak-keeper"  # the keeper's label: its value is the project
HOLDER = "pidns"  # the service that holds the job's PID and IPC namespaces (/dev/shm)
FILL_FILE = f"{STATE_DIR}/{soak_probes.FILL_PREFIX}"

PROBES = Path(soak_probes.__file__).read_text(encoding="utf-8")  # run as `python -c PROBES COMMAND ARG...`
READ_ONLY = ("audit", "shm")  # probes that change nothing: run again when their output is lost
PROBE_TRIES = 3
KEEP = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\nwhile True: time.sleep(60)\n"


def size_limited(doc: dict[str, Any], megabytes: int) -> dict[str, Any]:
    """The compose document with its state volume a tmpfs of `megabytes` MB owned by uid 1000 (pure)."""
    volumes = dict(doc["volumes"])
    volumes[STATE_VOLUME] = {
        **volumes[STATE_VOLUME],
        "driver": "local",
        "driver_opts": {"type": "tmpfs", "device": "tmpfs", "o": f"size={megabytes}m,uid=1000,gid=1000"},
    }
    return {**doc, "volumes": volumes}


def workers_limited(doc: dict[str, Any], cpus: Optional[float]) -> dict[str, Any]:
    """The compose document with each worker's container (the scale profile's too) held to `cpus`
    CPUs (compose's `cpus`, a CFS quota); None: as rendered (pure)."""
    if cpus is None:
        return doc
    services = {
        name: {**s, "cpus": cpus} if s.get("labels", {}).get(LABEL_ROLE) == "worker" else s
        for name, s in doc["services"].items()
    }
    return {**doc, "services": services}


class SoakJob(ContainerJob):
    """The chaos topology on a size-limited state volume, held mounted by a keeper; its workers
    held to `worker_cpus` CPUs each (None: no limit)."""

    def __init__(self, t: Topology, project: str, volume_mb: int, worker_cpus: Optional[float] = None) -> None:
        super().__init__(t, project)
        doc = workers_limited(size_limited(compose.render(t), volume_mb), worker_cpus)
        write_atomic(self.project.file, compose.dump(doc, t.name))
        self.volume = f"{project}_{STATE_VOLUME}"
        self.keeper: Optional[Any] = None

    def keep_volume(self) -> None:
        """Start the keeper (after `up` created the volume)."""
        self.keeper = self.client.containers.run(
            self.t.image_tag,
            entrypoint=["python", "-c", KEEP],
            volumes={self.volume: {"bind": STATE_DIR, "mode": "rw"}},
            user="1000:1000",
            network_mode="none",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges:true"],
            labels={KEEPER_LABEL: self.project.name},
            name=f"{self.project.name}-keeper",
            detach=True,
        )

    def remove_keeper(self) -> None:
        for c in self.client.containers.list(
            all=True, filters={"label": f"{KEEPER_LABEL}={self.project.name}"}, ignore_removed=True
        ):
            c.remove(force=True)
        self.keeper = None

    def close(self) -> None:
        self.remove_keeper()
        super().close()

    def probe(self, container: Any, command: str, *args: str) -> Any:
        """Run soak_probes' `command` in `container` as uid 1000; the JSON object it printed.

        The engine now and then hands back an exec's exit status without its output (moby/moby#27289,
        seen under load on a 2-core CPU VM): a probe that only reads (READ_ONLY) is run again; one
        that changed something is not, and says so."""
        for _ in range(PROBE_TRIES if command in READ_ONLY else 1):
            rc, output = container.exec_run(["python", "-c", PROBES, command, *args], user="1000:1000")
            text = output.decode("utf-8", "replace").strip()
            if rc != 0:
                raise RuntimeError(f"soak probe {command} in {container.name}: exit {rc}: {text.splitlines()[-1:]}")
            if text:
                return json.loads(text.splitlines()[-1])
        raise RuntimeError(f"soak probe {command} in {container.name}: exit 0, and the engine gave back no output")

    def in_keeper(self, command: str, *args: str) -> Any:
        assert self.keeper is not None, "keep_volume() first"
        return self.probe(self.keeper, command, *args)

    def read(self, path: str) -> Optional[bytes]:
        """A file of the state volume (None when it is not there)."""
        assert self.keeper is not None, "keep_volume() first"
        try:
            stream, _ = self.keeper.get_archive(path)
        except Exception:  # noqa: BLE001 - not written yet
            return None
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            f = tar.extractfile(member) if member is not None else None
            return f.read() if f is not None else None

    def records(self, name: str = "ps") -> list[Record]:
        """The records of process `name` (ps, ps1, worker2...)."""
        data = self.read(f"{METRICS_DIR}/{name}.jsonl")
        return parse_lines(data.decode("utf-8", "replace").splitlines()) if data else []

    def metrics_files(self) -> dict[str, list[str]]:
        """{file name: lines} of every metrics file (JSON lines) of the volume."""
        assert self.keeper is not None, "keep_volume() first"
        stream, _ = self.keeper.get_archive(METRICS_DIR)
        return metrics_from_tar(b"".join(stream))

    def audit(self) -> Audit:
        found = self.in_keeper("audit", STATE_DIR, CHECKPOINT_DIR)
        return Audit(found["time"], found["files"], found["temp"], found["final"])

    def fill(self, hold: float) -> dict[str, Any]:
        """Fill the volume's free space for `hold` seconds (blocks that long)."""
        return dict(self.in_keeper("fill", FILL_FILE, str(hold)))

    def corrupt_newest(self) -> dict[str, Any]:
        """Damage the newest checkpoint of the PS: {file, version}, or {} when there is none."""
        return dict(self.in_keeper("corrupt", CHECKPOINT_DIR))

    def shm(self) -> Optional[Shm]:
        """The job's /dev/shm and the segments each app process maps, seen from the holder (the
        job's PID and IPC namespaces); None when the holder has ended (and the namespace with it)."""
        holder = self.containers().get(HOLDER)
        if holder is None:
            return None
        holder.reload()
        if holder.status != "running":
            return None
        found = self.probe(holder, "shm", "/dev/shm", "/proc")
        return Shm(found["files"], found["procs"])

    def running(self, prefix: str = "") -> list[str]:
        """Services whose container runs now, by name."""
        return sorted(s for s, v in self.states().items() if v["status"] == "running" and s.startswith(prefix))

    def leftovers(self) -> dict[str, list[str]]:
        """What of the project is still on the engine: containers (the keeper too), its volume, its network."""
        name = self.project.name
        containers = [
            c.name
            for c in self.client.containers.list(
                all=True, filters={"label": f"{KEEPER_LABEL}={name}"}, ignore_removed=True
            )
        ]
        containers += [c.name for c in self.containers().values()]
        volumes = [v.name for v in self.client.volumes.list() if v.name.startswith(f"{name}_")]
        networks = [n.name for n in self.client.networks.list() if n.name.startswith(f"{name}_")]
        return {"containers": sorted(set(containers)), "volumes": volumes, "networks": networks}
