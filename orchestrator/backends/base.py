"""What a target does, in one interface: `Backend`.

A target (compose, swarm, kubernetes) renders a topology to its document, names the
doctor's checks for itself and the host facts only it needs, and, when the orchestrator
can run it, the lifecycle verbs up, down, logs, status and smoke. The CLI and doctor
call these and never compare target names; `orchestrator/backends/registry.py` lists
the targets. Adding one is a module that subclasses `Backend` and one registry line
(docs/design.md, "Adding a target").

Methods here import nothing heavy: a backend's verbs import the Docker SDK when called,
so `render` and `doctor --target kubernetes` run without it.
"""

from __future__ import annotations

from typing import Any, Optional

from orchestrator.doctor.checks import CheckFn
from orchestrator.doctor.facts import Facts
from orchestrator.errors import UsageError
from orchestrator.topology.model import Topology

LIFECYCLE = ("up", "down", "logs", "status", "smoke", "scale")


class Backend:
    """One target. Class attributes describe it; the CLI builds its verbs from them."""

    name: str = ""
    output: str = ""  # the file `render --target NAME` writes by default
    noun: str = ""  # what the rendered document starts: project, stack, job
    summary: str = ""  # one line for `render --target`'s help
    verb_prefix: Optional[str] = None  # lifecycle verbs as PREFIX + up...; None: the orchestrator runs none
    engine: bool = True  # doctor asks a local Docker engine for this target
    smoke_timeout: int = 900  # seconds, the smoke verb's default
    verb_help: dict[str, str] = {}

    # --- the document -------------------------------------------------------
    def render(self, t: Topology, data_root: str) -> str:
        """The target's document for `t` as text; `data_root` makes a relative
        train.data_dir absolute where the target needs host paths."""
        raise NotImplementedError

    def name_of(self, t: Topology) -> str:
        """The name the document gives the cluster (project, stack, job prefix)."""
        raise NotImplementedError

    # --- doctor -------------------------------------------------------------
    def checks(self) -> list[CheckFn]:
        """The doctor's checks for this target, in the order they print."""
        raise NotImplementedError

    def gather_facts(self, t: Topology, client: Any, facts: Facts, probe: bool) -> dict[str, Any]:
        """Facts only this target needs, as Facts fields (its own under `target`)."""
        return {}

    # --- the lifecycle verbs (targets the orchestrator runs) ----------------
    def up(self, config: str, workers: Optional[int], *, strategy: Optional[str], offline: bool, resume: bool) -> int:
        raise self._not_run("up")

    def down(self, config: Optional[str], workers: Optional[int], *, strategy: Optional[str], volumes: bool) -> int:
        raise self._not_run("down")

    def logs(self, config: Optional[str], workers: Optional[int], *, strategy: Optional[str], follow: bool) -> int:
        raise self._not_run("logs")

    def status(self, config: Optional[str], workers: Optional[int], *, strategy: Optional[str]) -> int:
        raise self._not_run("status")

    def smoke(self, config: str, workers: int, *, strategy: Optional[str], timeout: int) -> int:
        raise self._not_run("smoke")

    def scale(self, config: Optional[str], workers: int) -> int:
        """Grow or shrink the running cluster to `workers` workers without stopping it."""
        raise self._not_run("scale")

    def _not_run(self, verb: str) -> UsageError:
        return UsageError(f"target {self.name} has no {verb} verb: render it and use its own tools")
