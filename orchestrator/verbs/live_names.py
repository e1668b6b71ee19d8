"""One live run per name across the targets: a name that runs on one of them (a `local` run, a
compose project, a swarm stack) is refused on every other, in one line that says where it runs
and how to end it. They would share runs/<name>/ (the local run's directory, the targets'
documents and records) and, on one engine, the networks named after it. Every target names its
cluster after the topology's name (`Backend.name_of`), so one name is looked for on each.

What each target says of a name comes from its own block (`running_env`, as its own `up` asks
it) and, for `local`, from its lock (runs/<name>/local.lock, orchestrator/run_lock.py). A target
that cannot tell (no engine answers, this engine is in no swarm) has no live run to refuse.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from orchestrator import paths, run_lock, runs
from orchestrator.backends.base import Backend, Cluster
from orchestrator.errors import UsageError
from orchestrator.hints import command

LOCAL = "local"  # `here` for a `local` run: its processes on this host, no target's engine


def refuse_elsewhere(
    name: str, here: str, verb: str, another: str, backends: Iterable[Backend], runs_dir: Optional[Path] = None
) -> None:
    """UsageError (one line) when a run of `name` is live on a target other than `here` (LOCAL or
    a backend's name): a `local` run (its lock under `runs_dir`), then each of `backends` the
    orchestrator runs. `verb`: the command refused as the user typed it (`local`, `up`,
    `stack-up`); `another`: that command under another name, the first way out."""
    if here != LOCAL:
        live = run_lock.live_run((runs_dir or paths.RUNS) / name)
        if live is not None:
            raise UsageError(
                f"{verb}: a local run {live or '(no id)'} of {name} is live (runs/{name}/local.lock); "
                f"give this one another name ({another}), or end that one first (Ctrl-C where it runs)"
            )
    for backend in backends:
        if backend.name == here or backend.verb_prefix is None:
            continue
        found = live_on(backend, name)
        if found is not None:
            raise UsageError(
                f"{verb}: {backend.noun} {name} of target {backend.name} has a live run {found or '(no id)'}; "
                f"give this one another name ({another}), "
                f"or end that one first ({command(backend.verb('down'), NAME=name)})"
            )


def live_on(backend: Backend, name: str) -> Optional[str]:
    """The id of the run of `name` live on `backend` ('' when it has none recorded), or None when
    none is, or the target cannot tell."""
    try:
        live = backend.running_env(Cluster(name, backend.path_of(name)), runs.VARIABLES)
    except Exception:  # noqa: BLE001 - no engine, no swarm, a daemon that refused: it cannot tell
        return None
    return live.get(runs.RUN_ID, "") if live else None
