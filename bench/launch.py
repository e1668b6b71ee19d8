"""The app run whole, as a user runs it, for the benches that time `python -m app` itself:
through the run handle every target shares (orchestrator/backends/target_run.py), as local
processes (a launcher, `python -m orchestrator local`) or as a compose project of its own,
never another run's containers or `runs/current.json`. Its directory is a scratch one (the
checkout's runs/ stays untouched), and a compose project is removed with its volume afterwards.
`metrics` returns the run's metrics files' lines (`{file name: lines}`). Compose needs a Docker
engine (`make engine`)."""

from __future__ import annotations

import io
import re
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = re.compile(r"(exited with code|stopped \(code) ")  # the local launcher's own words of a process


def metrics(target: str, topology: Any, timeout: float, project: str = "") -> dict[str, list[str]]:
    """`topology` (a Topology, or its mapping) run to its end on `target` (local, compose),
    under `project` (default: its name); RuntimeError when it does not end within `timeout`
    seconds or a service ends non-zero."""
    from orchestrator.backends.base import Cluster
    from orchestrator.backends.registry import RUNNING
    from orchestrator.backends.target_run import TargetRun, Timeout
    from orchestrator.topology.model import Topology
    from orchestrator.topology.services import PS_SERVICE

    t = topology if isinstance(topology, Topology) else Topology.model_validate(topology)
    backend = RUNNING[target]
    with tempfile.TemporaryDirectory(prefix=f"bench-{target}-") as tmp:
        run = TargetRun(backend, t, Cluster(project or t.name, Path(tmp) / t.name / backend.output, topology=t))
        try:
            run.up()
            try:
                codes = run.ended(timeout)
            except Timeout:
                raise RuntimeError(f"the {target} run did not end within {timeout:.0f} s") from None
            failed = {name: code for name, code in codes.items() if code != 0}
            if failed:
                said = {name: [x for x in run.log(name).splitlines() if x and not LAUNCHER.match(x)] for name in failed}
                tail = " | ".join(f"{name}: {lines[-1]}" for name, lines in said.items() if lines)
                raise RuntimeError(f"the {target} run ended badly {failed}: {tail}")
            return backend.read_records(run.c, PS_SERVICE)
        finally:
            run.close()


def build_image(model: Any) -> None:
    """The topology's image, FROM the offline base (the layer cache makes a rebuild quick)."""
    from orchestrator import images

    base, pip_source = images.source(model, offline=True)
    images.build(model.image_tag, base, pip_source, out=io.StringIO())
