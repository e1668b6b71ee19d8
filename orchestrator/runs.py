"""A run's identity: every `up`, `stack-up` and `local` starts one run with a new id.

The PS writes the id into every checkpoint (the app's `--run_id`): restarted
within its run (a container restart keeps its environment, so the same id)
it resumes; a new run starts at version 0 and sets the checkpoints it finds
aside (`<checkpoint_dir>/previous/<their run id>/`, never deleted), unless
`--resume` (`make up RESUME=1`) asks it to continue the newest one.

The rendered files stay the same from run to run: they read both variables
from the environment of the `docker compose` / `docker stack deploy` call
(`${PSC_RUN_ID:-}`), which `environment` gives.
"""

from __future__ import annotations

import secrets
import time
from typing import Optional, Union

RUN_ID = "PSC_RUN_ID"  # the app's --run_id
RESUME = "PSC_RESUME"  # the app's --resume
VARIABLES = (RUN_ID, RESUME)
# What an `up` (`stack-up`, `local`) starts: False, a new run at version 0; True (`--resume`), a new
# run that continues the newest unfinished checkpoint; a run id (`--resume RUN_ID`), that run again,
# under its own id, from its newest checkpoint (moved back where a later run set it aside).
Resume = Union[bool, str]


def chosen(resume: Resume) -> str:
    """The run id `--resume RUN_ID` gave; "" for a new run."""
    return resume if isinstance(resume, str) else ""


def interpolated() -> dict[str, str]:
    """What the compose and stack files say: each variable taken from the caller's environment
    when the file is used (empty when unset: the app then resumes any checkpoint)."""
    return {name: f"${{{name}:-}}" for name in VARIABLES}


def new_id(now: Optional[float] = None) -> str:
    """A new run id: UTC time to the second, then 6 random hex digits (sortable, unique)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(3)}"


def environment(run_id: str, resume: Resume) -> dict[str, str]:
    """The variables for the PS (and every process) of run `run_id`."""
    return {RUN_ID: run_id, RESUME: "true" if resume else "false"}


def describe(run_id: str, resume: Resume, kept: bool = False) -> str:
    """One line for the CLI: which run, and what the PS does with older checkpoints."""
    if kept:
        return f"run {run_id} (still running: its id is kept, so its PS resumes its own checkpoints)"
    if chosen(resume):
        return (
            f"run {run_id} again (--resume {run_id}): the PS continues its newest checkpoint, moved back where "
            "a later run set it aside (its log says which version)"
        )
    if resume:
        return f"run {run_id}: --resume: the PS continues the newest unfinished checkpoint (its log says which version)"
    return (
        f"run {run_id}: starts fresh at version 0; older checkpoints are moved to "
        "checkpoints/previous/<their run>/ (RESUME=1 / --resume continues the newest instead)"
    )


def start(running: dict[str, str], resume: Resume) -> tuple[dict[str, str], str]:
    """The variables for an `up` / `stack-up` and its one line: those of the run still going
    on (`running`, read from its containers: compose and Swarm then restart nothing), else
    those of the run `--resume RUN_ID` chose, else a new run's."""
    if running.get(RUN_ID):
        return dict(running), describe(running[RUN_ID], resume, kept=True)
    run_id = chosen(resume) or new_id()
    return environment(run_id, resume), describe(run_id, resume)
