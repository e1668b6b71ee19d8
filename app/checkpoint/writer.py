"""A training state's checkpoints: periodic, on exit, on a finish, and final.pt (the resume decision
is app.checkpoint.resume's).

Used by the PS (app.ps.process), a PS shard (app.ps.sharding.shard_process) and a DDP
job's rank 0 (app.allreduce.job): anything `Checkpointable`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from app.checkpoint import files as checkpoint_files
from app.checkpoint import resume
from app.config import Config
from app.contract import worker_name
from app.training.metrics import MetricsWriter

log = logging.getLogger("app.checkpoint")
RETRY_SECONDS = 5.0  # final.pt that did not fit: tried again this often
REMIND_SECONDS = 60.0  # ... and said again this often


class Checkpointable(Protocol):
    """What a Checkpointer saves and restores (app.ps.server.ParameterServer, app.allreduce.trainer.JobState)."""

    @property
    def version(self) -> int: ...

    def checkpoint(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


class Checkpointer:
    """Periodic, on-exit and final checkpoints of one training state (`server`)."""

    def __init__(
        self,
        server: Checkpointable,
        config: Config,
        identity: dict[str, Any],
        metrics: MetricsWriter,
        before_save: Callable[[int], None] | None = None,
    ) -> None:
        self.server, self.config, self.identity, self.metrics = server, config, identity, metrics
        self.directory = Path(config.checkpoint_dir)
        self.next_version = server.version + config.checkpoint_every if config.checkpoint_every else 0
        self.saved_version = -1  # the version on disk already (written or resumed from)
        self.saved_run = ""  # ... and the run id it carries
        self.saved_file = ""  # ... and the file that holds it
        # A sharded main PS: the other shards write theirs, labelled with this version, before
        # this one is written (app.ps.sharding.shardset); raises if one could not.
        self.before_save: Callable[[int], None] = before_save or (lambda version: None)
        self._lock = threading.Lock()  # a finish's checkpoint comes from an RPC thread
        self.run_finished = ""  # set by `resume` when this run id has already finished

    def resume(self) -> None:
        """Continue from the newest good checkpoint this run continues, or start at version 0
        (app.checkpoint.resume decides, and sets aside what it does not continue).

        A checkpoint directory this process cannot write to is a UsageError now, not a
        warning at every checkpoint and a failure at the end; one with room for fewer than
        two checkpoints is a warning (`check_room`). `run_finished` is set (one line for the
        log) when this run id has already finished: its final.pt stays."""
        checkpoint_files.check_writable(self.directory)  # creates it when missing
        if checkpoint_files.remove_temp_files(self.directory):
            log.info("removed temp files of an interrupted checkpoint write in %s", self.directory)
        decision = resume.decide(self.directory, self.config, self.identity)
        if decision.finished:
            self.run_finished = decision.finished
            return
        if decision.found is not None:
            self._restore(*decision.found)
        self.check_room()

    def _restore(self, path: Path, state: dict[str, Any]) -> None:
        self.server.restore(state)
        self.saved_version, self.saved_file = self.server.version, path.name
        run = self.saved_run = state.get("run_id", "")
        how = "" if run == self.config.run_id else f" (run {run or 'without an id'}, continued by --resume)"
        log.info("resumed from %s: version %d%s", path, state["version"], how)
        self.metrics.write("resume", self.server.version, checkpoint=path.name, run_id=run)
        if self.config.checkpoint_every:
            self.next_version = self.server.version + self.config.checkpoint_every

    def check_room(self) -> None:
        """Warn (one line) when the checkpoint directory has room for fewer than two checkpoints
        (a checkpoint is written beside the previous one before that one goes; final.pt beside
        the last): found at the start, not when the final model does not fit."""
        state = self._state()
        nbytes = checkpoint_files.tensor_bytes(state)
        if self.config.momentum and not state.get("optimizer", {}).get("state"):
            nbytes += checkpoint_files.tensor_bytes(state.get("model") or state.get("vector"))  # momentum to come
        free, largest = checkpoint_files.room(self.directory)
        if free >= 2 * nbytes and (largest is None or largest >= nbytes):
            return
        size = checkpoint_files.size_text
        limit = f", and files are limited to {size(largest)} (ulimit -f)" if largest is not None else ""
        log.warning(
            "--checkpoint_dir %s: %s free%s, room for fewer than two checkpoints of about %s: "
            "checkpoints and final.pt may not fit; free space there (the state volume)",
            self.directory,
            size(free),
            limit,
            size(nbytes),
        )

    def due(self) -> bool:
        return 0 < self.next_version <= self.server.version

    def finished(self, rank: int) -> None:
        """Rank finished: checkpoint now (before it hears back), so a PS that crashes
        before the next periodic checkpoint does not wait for it again."""
        self.save(f"{worker_name(rank)} finished", always=True)

    def save(self, why: str, always: bool = False, on_exit: bool = False) -> None:
        """A periodic or on-exit checkpoint (`always`: even at the version on disk); a
        failure (disk full...) is a warning, and the checkpoints already written stay.
        Nothing is written at version 0: a run that applied nothing has nothing to keep
        (and would otherwise hide the run it set aside from --resume). `on_exit`: the
        process is stopping; a sharded PS's other shards may be gone or going, and each
        writes its own slice on its way out, so this one is written whatever they answer."""
        with self._lock:
            self._save(why, always, on_exit)

    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds: the training state, the job's identity and this run's id."""
        return {**self.server.checkpoint(), **self.identity, "run_id": self.config.run_id}

    def _save(self, why: str, always: bool, on_exit: bool = False) -> None:
        state = self._state()
        if state["version"] == 0:
            return
        if state["version"] == self.saved_version and not always:
            if on_exit and self.saved_file:
                self._already(state["version"], why)
            return
        if self.config.checkpoint_every:
            self.next_version = (state["version"] // self.config.checkpoint_every + 1) * self.config.checkpoint_every
        start = time.monotonic()
        try:
            try:
                self.before_save(state["version"])
            except Exception as error:  # noqa: BLE001 - a shard that is gone
                if not on_exit:
                    raise
                log.info(
                    "checkpoint at version %d (%s): the other shards write their own slices on exit (%s)",
                    state["version"],
                    why,
                    error,
                )
                state["exit"] = True
            path = checkpoint_files.save(state, self.directory)
        except Exception as error:  # noqa: BLE001 - disk full, read-only...: training goes on
            log.warning(
                "checkpoint at version %d (%s) not written: %s; the earlier ones are intact",
                state["version"],
                why,
                error,
            )
            return
        seconds = time.monotonic() - start
        self.saved_version, self.saved_run, self.saved_file = state["version"], self.config.run_id, path.name
        log.info("checkpoint %s (%s, %.2f s)", path.name, why, seconds)
        self.metrics.write("checkpoint", state["version"], file=path.name, why=why, seconds=round(seconds, 3))

    def _already(self, version: int, why: str) -> None:
        """On exit at the version the newest checkpoint holds (the last push was checkpointed,
        or nothing was applied since the resume): nothing is written, and the record names that
        file (`written: false`), so that the state at the exit is on record either way."""
        log.info("checkpoint %s holds version %d already (%s): nothing new to write", self.saved_file, version, why)
        self.metrics.write("checkpoint", version, file=self.saved_file, why=why, seconds=0.0, written=False)

    def final(self, model: dict[str, torch.Tensor] | None = None) -> None:
        """final.pt, then the last checkpoint (marked finished).

        The trained model is never let go of unsaved: when final.pt cannot be written (a full
        state volume...), one line says where, how much it needs and how much is free, and
        the write is tried again every RETRY_SECONDS until it succeeds; SIGTERM meanwhile
        gets one more try, then the exit goes on. A finished checkpoint that cannot be written
        after final.pt is a warning: final.pt alone marks the run finished (`resume`).

        `model`: the whole model's state dict, for a sharded PS whose own state is a slice."""
        state = self._state()
        saved = state
        if model is not None:
            saved = {k: v for k, v in state.items() if k not in ("vector", "part", "optimizer")}
            saved["model"] = model
        data = checkpoint_files.serialize(saved)
        path = self.directory / "final.pt"
        start = time.monotonic()
        error = self._write_final(data, path)
        if error is not None:
            try:
                self._hold(data, path, state["version"], error)
            except SystemExit:  # stopped while waiting for room: one more try, then exit
                error = self._write_final(data, path)
                if error is not None:
                    log.error(
                        "stopped (SIGTERM) with final.pt still not written in %s (%s): the model trained to "
                        "version %d is lost; the newest checkpoint on disk is %s",
                        self.directory,
                        error.strerror or error,
                        state["version"],
                        f"version {self.saved_version}" if self.saved_version >= 0 else "none",
                    )
                else:
                    self._saved_final(state, path, start)
                raise
        self._saved_final(state, path, start)

    def _write_final(self, data: bytes, path: Path) -> OSError | None:
        """Write final.pt; the error when it could not be."""
        try:
            with self._lock:
                checkpoint_files.write_atomically(data, path)
        except OSError as error:
            return error
        return None

    def _hold(self, data: bytes, path: Path, version: int, error: OSError) -> None:
        """Keep trying to write final.pt (the model trained to `version`) until it is written;
        one line now, one more every REMIND_SECONDS."""
        waited = 0.0
        while error is not None:
            if waited % REMIND_SECONDS == 0:
                free, largest = checkpoint_files.room(self.directory)
                size = checkpoint_files.size_text
                limit = f", files limited to {size(largest)}" if largest is not None else ""
                log.error(
                    "final.pt not written in %s (%s; it needs %s, %s free there%s)%s: the model "
                    "trained to version %d is kept in memory; free space there (the state volume): the write "
                    "is tried again every %.0f s (and once more on SIGTERM)",
                    self.directory,
                    error.strerror or error,
                    size(len(data)),
                    size(free),
                    limit,
                    f", waiting for {waited:.0f} s" if waited else "",
                    version,
                    RETRY_SECONDS,
                )
            time.sleep(RETRY_SECONDS)
            waited += RETRY_SECONDS
            error = self._write_final(data, path)  # type: ignore[assignment]

    def _saved_final(self, state: dict[str, Any], path: Path, start: float) -> None:
        """final.pt is written: its record (workers that start after the end read it), then the
        last checkpoint, marked finished when every rank finished."""
        seconds = time.monotonic() - start
        log.info("saved %s (version %d, %.2f s)", path, state["version"], seconds)
        self.metrics.write("checkpoint", state["version"], file=path.name, why="final", seconds=round(seconds, 3))
        try:
            with self._lock:
                checkpoint_files.save(state, self.directory)
        except OSError as error:
            log.warning(
                "the last checkpoint (version %d) not written (%s); final.pt marks run %s finished",
                state["version"],
                error.strerror or error,
                self.config.run_id or "without an id",
            )
