"""TensorBoard event files: the metrics records' numbers as scalars, one directory per run and process.

`<metrics_dir>/tensorboard/<run id>/<process name>/` (app/contract.py `event_dir`): TensorBoard
pointed at `<metrics_dir>/tensorboard` shows every run side by side, each process as its own
curve set. A scalar is tagged `<event>/<field>` after the record it comes from (`train/loss`,
`eval/accuracy`), at the record's `step`, so its value is the JSONL record's value.

A process that starts again (a restarted container, `--resume`) starts at the step its
checkpoint holds (the PS's version, a worker's pushes) and writes the steps after it: the
writer's `purge_step` marks the earlier process's points past that step as dropped, so a
curve has one point per step. Without the `tensorboard` package the app runs on, JSONL only.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from app.contract import event_dir

log = logging.getLogger(__name__)

FLUSH_SECONDS = 5  # the newest points reach the files (and TensorBoard) at most this late
# The records' fields that become scalars, per event (design.md: Metrics).
SCALARS = {
    "train": ("loss", "step_seconds", "samples_per_s", "staleness"),
    "eval": ("accuracy", "loss", "updates_per_s", "samples_per_s", "staleness", "workers"),
    "end": ("accuracy", "loss"),
}


def scalars(event: str, fields: dict[str, Any]) -> dict[str, float]:
    """The tags and values a record of `event` with `fields` gives (numbers only)."""
    out = {}
    for name in SCALARS.get(event, ()):
        value = fields.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"{event}/{name}"] = float(value)
    return out


class EventFiles:
    """A SummaryWriter for one process of one run, opened at the step it starts from."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    @classmethod
    def open(cls, metrics_dir: str, run_id: str, name: str, step: int) -> EventFiles | None:
        """The event files of process `name` in run `run_id`, which starts at `step`; None (and one
        warning) when TensorBoard's writer cannot be imported or the directory cannot be made."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            log.warning("no TensorBoard event files (%s): metrics go to the JSON lines only", error)
            return None
        directory = event_dir(metrics_dir, run_id, name)
        try:
            return cls(SummaryWriter(directory, purge_step=step + 1, flush_secs=FLUSH_SECONDS))
        except OSError as error:
            log.warning("no TensorBoard event files in %s (%s): metrics go to the JSON lines only", directory, error)
            return None

    def write(self, event: str, step: int, fields: dict[str, Any], wall_time: float) -> None:
        for tag, value in scalars(event, fields).items():
            self._writer.add_scalar(tag, value, global_step=step, walltime=wall_time)

    def close(self) -> None:
        self._writer.close()
