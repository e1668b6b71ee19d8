"""`python -m orchestrator chaos`: the scenarios by name, run one after the other, then a table.

The kills of a worker, the PS and a PS shard (`chaos.faults`), written once and run as
processes (`chaos.processes`: each process that fails started again, as compose does) and in
containers (`chaos.containers`, Docker needed). As processes only: SIGSTOP a worker and
SIGCONT it; kill -9 a process in the middle of checkpoint writes, again and again
(`chaos.checkpoints`). In containers only: `make down` mid-run and `make up RESUME=1`, and
`make scale`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
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


def long_runs() -> dict[str, Callable[..., int]]:
    """The long runs by name, each (minutes, seed, run_dir, out=..., name=..., faults=...) -> exit status;
    they import the Docker SDK, so on use."""
    from orchestrator.chaos import soak

    return {"soak": soak.run}


def series() -> dict[str, Callable[..., int]]:
    """The long runs that run several seeds, each (minutes, count, run_dir, out=..., name=..., faults=...)."""
    from orchestrator.chaos import soak

    return {"soak": soak.run_seeds}


LONG_RUNS = ("soak",)  # the names long_runs() gives, known without importing them


def run_long(
    names: list[str],
    run_root: Path,
    containers: bool,
    minutes: float,
    seed: Optional[int],
    out: TextIO,
    seeds: Optional[int] = None,
    name: Optional[str] = None,
    faults: int = 0,
) -> int:
    """A long run, alone and in containers (`seeds`: that many, one table; `faults`: at least that
    many in each); 2 (one line) when asked otherwise."""
    if len(names) > 1 or not containers:
        print(f"chaos: {names[0]} runs alone and in containers (no other scenario, no --no-containers)", file=out)
        return 2
    if seeds is not None:
        return series()[names[0]](minutes, seeds, run_root / names[0], out=out, name=name, faults=faults)
    return long_runs()[names[0]](minutes, seed, run_root / names[0], out=out, name=name, faults=faults)


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


def run(
    names: list[str],
    run_root: Path,
    containers: bool,
    out: Optional[TextIO] = None,
    minutes: float = 10.0,
    seed: Optional[int] = None,
    seeds: Optional[int] = None,
    project: Optional[str] = None,
    faults: int = 0,
) -> int:
    """Run the named scenarios (all by default), or one long run (`seeds`: a series of them,
    `project`: its name); print the table (on `out`, else stdout); 0 when all recovered."""
    out = out or sys.stdout
    if any(name in LONG_RUNS for name in names):
        return run_long(names, run_root, containers, minutes, seed, out, seeds=seeds, name=project, faults=faults)
    if seeds is not None or project is not None or faults:
        print(f"chaos: --seeds, --faults and --name are for {' and '.join(LONG_RUNS)} only", file=out)
        return 2
    known = scenarios(containers)
    outcomes = []
    for name in names or list(known):
        if name not in known:
            print(f"chaos: unknown scenario {name!r}; known: {', '.join([*known, *LONG_RUNS])}", file=out)
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
