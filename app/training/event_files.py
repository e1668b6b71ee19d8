"""TensorBoard event files: the metrics records' numbers as scalars, one directory per run and process.

`<metrics_dir>/tensorboard/<run id>/<process name>/` (app/contract.py `event_dir`): TensorBoard
pointed at `<metrics_dir>/tensorboard` shows every run side by side, each process as its own
curve set. A scalar is tagged `<event>/<field>` after the record it comes from (`train/loss`,
`eval/accuracy`), at the record's `step`, so its value is the JSONL record's value.

A process that starts again (a restarted container, `--resume`) starts at the step its
checkpoint holds (the PS's version, a worker's pushes) and writes the steps after it: the
writer's `purge_step` marks the earlier process's points past that step as dropped, so a
curve has one point per step. Without the `tensorboard` package the app runs on, JSONL only.

The run's settings (the start record's strategy, model, dataset, batch size, workers, shards,
precision, compression) and its final metrics (the end record's) go to TensorBoard's HPARAMS tab
when the run ends: one row per run and process, its settings beside its headline.

A volume that fills up is a warning, never a failure: TensorBoard's writer thread dies on the
error and its writer raises it at the next scalar; one line says the scalars are dropped, and
once the JSON lines fit again (room was made) a new event file takes the scalars after it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from app.contract import event_dir

log = logging.getLogger(__name__)

FLUSH_SECONDS = 5  # the newest points reach the files (and TensorBoard) at most this late
RETRY_SECONDS = 30.0  # event files that could not be written: a new one tried at most this often
# The records' fields that become scalars, per event (design.md: Metrics).
# An eval or end record's own metrics (its `metrics`: accuracy, perplexity, the user's) too.
SCALARS = {
    "train": ("loss", "step_seconds", "samples_per_s", "staleness"),
    "eval": ("accuracy", "loss", "lr", "updates_per_s", "samples_per_s", "staleness", "workers"),
    "end": ("accuracy", "loss"),
}

# The start record's fields that describe a run in TensorBoard's HPARAMS tab.
HPARAMS = ("strategy", "model", "dataset", "batch_size", "workers", "shards", "precision", "compress")


def scalars(event: str, fields: dict[str, Any]) -> dict[str, float]:
    """The tags and values a record of `event` with `fields` gives (numbers only)."""
    out = {}
    own = fields.get("metrics", ()) if event in ("eval", "end") else ()
    for name in dict.fromkeys([*own, *SCALARS.get(event, ())]):
        value = fields.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"{event}/{name}"] = float(value)
    return out


class EventFiles:
    """A SummaryWriter for one process of one run, opened at the step it starts from; its
    scalars dropped (one warning) while they do not fit."""

    def __init__(self, writer: Any, directory: str = "") -> None:
        self._writer: Any | None = writer  # None while the volume is full
        self.directory = directory
        self._retry_at = 0.0
        self._hparams: dict[str, Any] = {}  # the start record's settings, written with the end's metrics

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
        _quiet_writer_threads()
        try:
            return cls(SummaryWriter(directory, purge_step=step + 1, flush_secs=FLUSH_SECONDS), directory)
        except OSError as error:
            log.warning("no TensorBoard event files in %s (%s): metrics go to the JSON lines only", directory, error)
            return None

    def write(self, event: str, step: int, fields: dict[str, Any], wall_time: float, room: bool = True) -> None:
        """The record's scalars; dropped while the event files do not fit. `room`: the record's
        JSON line fit, so a new event file is worth a try."""
        if event == "start":
            self._hparams = {k: fields[k] for k in HPARAMS if isinstance(fields.get(k), (str, int, float, bool))}
        values = scalars(event, fields)
        writer = (self._writer or self._reopen(room)) if values else None
        if writer is None:
            return
        try:
            for tag, value in values.items():
                writer.add_scalar(tag, value, global_step=step, walltime=wall_time)
            if event == "end" and self._hparams:
                self._write_hparams(writer, values)
        except OSError as error:
            self._drop(error, "scalars are dropped until there is room again (the JSON lines keep what fits)")

    def _write_hparams(self, writer: Any, metrics: dict[str, float]) -> None:
        """The run's settings and its end record's metrics (scalar tags of this directory) as
        TensorBoard's hparams summaries, in this process's own event file."""
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(self._hparams, metrics):
            writer.file_writer.add_summary(summary)

    def _reopen(self, room: bool) -> Any | None:
        """A new event file after a failed one, once there is room again (not more often than
        every RETRY_SECONDS); its writer, or None."""
        if not room or time.monotonic() < self._retry_at:
            return None
        self._retry_at = time.monotonic() + RETRY_SECONDS
        from torch.utils.tensorboard import SummaryWriter

        try:
            self._writer = SummaryWriter(self.directory, flush_secs=FLUSH_SECONDS)
        except OSError:
            return None
        log.info(
            "TensorBoard event files in %s: written again (a new file; the scalars meanwhile were dropped)",
            self.directory,
        )
        return self._writer

    def _drop(self, error: OSError, what: str) -> None:
        """The writer failed (its thread died on `error`): one warning, and no writer until `_reopen`."""
        log.warning("TensorBoard event files in %s not written (%s): %s", self.directory, error.strerror or error, what)
        writer, self._writer = self._writer, None
        self._retry_at = time.monotonic() + RETRY_SECONDS
        try:
            if writer is not None:
                writer.close()
        except OSError:
            pass  # the same error again: said already

    def close(self) -> None:
        if self._writer is None:
            return
        try:
            self._writer.close()
        except OSError as error:
            self._drop(error, "the last scalars are lost (the JSON lines keep what fits)")
        self._writer = None


def _quiet_writer_threads() -> None:
    """TensorBoard's writer thread ends on the error a full volume gives, and Python prints its
    traceback; the writer raises the same error at the next scalar (or at close), which
    `EventFiles` says in one line. Other threads' errors are printed as ever."""
    previous = threading.excepthook
    if getattr(previous, "event_files_quiet", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            return
        previous(args)

    hook.event_files_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook
