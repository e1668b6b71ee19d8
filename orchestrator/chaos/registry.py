"""`python -m orchestrator chaos`: the scenarios by name, run one after the other, then a table.

As processes (`chaos.processes`, `chaos.checkpoints`): kill -9 a worker and
start it again; SIGSTOP a worker and SIGCONT it; kill -9 the PS, then restart
everything; kill -9 a process in the middle of checkpoint writes, again and
again. In containers (`chaos.containers`, Docker needed): the same faults
inside the containers, and `make down` mid-run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional, TextIO

from orchestrator.chaos import checkpoints, processes
from orchestrator.chaos.common import Outcome, Scenario


def scenarios(containers: bool) -> dict[str, Scenario]:
    """Every scenario by name; the container ones only when asked (they import the Docker SDK)."""
    found: dict[str, Scenario] = {**processes.SCENARIOS, **checkpoints.SCENARIOS}
    if containers:
        from orchestrator.chaos import containers as in_containers
        from orchestrator.chaos import swarm

        found.update(in_containers.SCENARIOS)
        found.update(swarm.SCENARIOS)
    return found


def table(outcomes: list[Outcome]) -> list[str]:
    def secs(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.1f} s"

    rows = [("FAULT", "RECOVERED", "DETECTED", "RECOVERED IN", "ACCURACY", "NOTES")]
    for o in outcomes:
        recovered = "skipped" if o.skipped else "yes" if o.recovered else "NO"
        rows.append(
            (
                o.fault,
                recovered,
                secs(o.detected_s),
                secs(o.recovered_s),
                "-" if o.accuracy is None else f"{o.accuracy:.4f}",
                o.notes,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]


def run(names: list[str], run_root: Path, containers: bool, out: TextIO = sys.stdout) -> int:
    """Run the named scenarios (all by default); print the table; 0 when all recovered."""
    known = scenarios(containers)
    outcomes = []
    for name in names or list(known):
        if name not in known:
            print(f"chaos: unknown scenario {name!r}; known: {', '.join(known)}", file=out)
            return 2
        print(f"==> chaos: {name}", file=out, flush=True)
        run_dir = run_root / name
        start = time.monotonic()
        outcome = known[name](run_dir)
        if outcome.skipped:
            print(f"    skipped: {outcome.notes}", file=out, flush=True)
            outcomes.append(outcome)
            continue
        print(
            f"    {'recovered' if outcome.recovered else 'NOT recovered'} in {time.monotonic() - start:.0f} s: "
            f"{outcome.notes} (logs and metrics in {run_dir})",
            file=out,
            flush=True,
        )
        outcomes.append(outcome)
    print(file=out)
    for line in table(outcomes):
        print(line, file=out)
    return 0 if all(o.recovered or o.skipped for o in outcomes) else 1
