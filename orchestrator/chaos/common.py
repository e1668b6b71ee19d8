"""The kit every chaos scenario shares: its topology, its outcome, polling.

A scenario runs the cpu-smoke topology (3 workers, more epochs so that a
fault lands mid-run, short timeouts) and returns an `Outcome`: did the run
recover, how long until the PS noticed, how long until the job was whole
again, the final held-out accuracy. Nothing here imports a scenario.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from orchestrator.backends.target_run import RUN_TIMEOUT, Timeout, wait_until
from orchestrator.paths import SMOKE_CONFIG
from orchestrator.topology.model import Topology, load_with

THRESHOLD = 0.90
CHECKPOINT_VERSION = 200  # the PS scenarios strike once a checkpoint this new exists


def chaos_topology(config: str = SMOKE_CONFIG, workers: int = 3) -> Topology:
    """The smoke topology with runs long enough to be hit mid-run, and short timeouts."""
    t = load_with(config, workers=workers)
    train = dataclasses.replace(t.train, epochs=30, eval_every=500, log_every=5)
    ps = dataclasses.replace(t.ps, rpc_timeout=10, join_timeout=60, checkpoint_every=100)
    return t.model_copy(update={"train": train, "ps": ps})


@dataclass
class Outcome:
    fault: str
    recovered: bool = False
    detected_s: Optional[float] = None  # fault -> the PS (or the workers) noticed
    recovered_s: Optional[float] = None  # fault -> the job is whole and training again
    accuracy: Optional[float] = None
    notes: str = ""
    skipped: bool = False  # what it needs is not here (notes say what); neither recovered nor failed
    details: dict[str, Any] = field(default_factory=dict)


__all__ = ["RUN_TIMEOUT", "Timeout", "wait_until"]  # the run handle's, where every scenario takes them

Scenario = Callable[..., Outcome]  # (run_dir, ...) -> Outcome
