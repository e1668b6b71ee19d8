"""A training state's checkpoints: resume from the newest good one, periodic, on exit, on a finish, final.

Used by the PS (app.ps.process), a PS shard (app.ps.sharding.shard_process) and a DDP
job's rank 0 (app.ddp): anything `Checkpointable`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from app.common import checkpoint_files
from app.common.metrics import MetricsWriter
from app.config import Config
from app.contract import worker_name

log = logging.getLogger("app.ps")


class Checkpointable(Protocol):
    """What a Checkpointer saves and restores (app.ps.server.ParameterServer, app.ddp.JobState)."""

    @property
    def version(self) -> int: ...

    def checkpoint(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


class Checkpointer:
    """Periodic, on-exit and final checkpoints of one training state (`server`)."""

    def __init__(
        self, server: Checkpointable, config: Config, identity: dict[str, Any], metrics: MetricsWriter
    ) -> None:
        self.server, self.config, self.identity, self.metrics = server, config, identity, metrics
        self.directory = Path(config.checkpoint_dir)
        self.next_version = server.version + config.checkpoint_every if config.checkpoint_every else 0
        self.saved_version = -1  # the version on disk already (written or resumed from)
        self.saved_run = ""  # ... and the run id it carries
        # A sharded main PS: the other shards write theirs, labelled with this version, before
        # this one is written (app.ps.sharding.shardset); raises if one could not.
        self.before_save: Callable[[int], None] = lambda version: None
        self._lock = threading.Lock()  # a finish's checkpoint comes from an RPC thread
        self.run_finished = ""  # set by `resume` when this run id has already finished

    def resume(self) -> None:
        """Continue from the newest good checkpoint of an unfinished run of this job, when it
        is this run's (same --run_id: a restarted PS), or --resume, or no run id was given.

        Otherwise this is a new run: it starts at version 0 and sets the files it found aside
        (`checkpoint.set_aside`, one log line saying where), so they are neither resumed nor
        pruned by this run's checkpoints. With --resume and nothing to continue here, the
        newest unfinished run set aside earlier (`previous/`) is moved back and continued.

        A checkpoint directory this process cannot write to is a UsageError now, not a
        warning at every checkpoint and a failure at the end. `run_finished` is set (one
        line for the log) when this run id has already finished: its final.pt stays."""
        checkpoint_files.check_writable(self.directory)  # creates it when missing
        if checkpoint_files.remove_temp_files(self.directory):
            log.info("removed temp files of an interrupted checkpoint write in %s", self.directory)
        found = checkpoint_files.newest_good(self.directory)
        if found is not None and self._finished_here(found[1]):
            path, state = found
            self.run_finished = (
                f"run {self.config.run_id} already finished at version {state['version']} "
                f"({path.name}; {self.directory / 'final.pt'} kept): nothing to do"
            )
            return
        if found is not None and self._not_resumable(found[1]):
            self._start_fresh(*found, self._not_resumable(found[1]))
            found = None
        if found is None and self.config.resume:
            found = self._from_previous()
        if found is None:
            return
        path, state = found
        self.server.restore(state)
        self.saved_version = self.server.version
        run = self.saved_run = state.get("run_id", "")
        how = "" if run == self.config.run_id else f" (run {run or 'without an id'}, continued by --resume)"
        log.info("resumed from %s: version %d%s", path, state["version"], how)
        self.metrics.write("resume", self.server.version, checkpoint=path.name, run_id=run)
        if self.config.checkpoint_every:
            self.next_version = self.server.version + self.config.checkpoint_every

    def _finished_here(self, state: dict[str, Any]) -> bool:
        """This run (same non-empty run id, same job) ended: a restart of its PS has nothing to do."""
        return bool(
            state["finished"]
            and self.config.run_id
            and state.get("run_id") == self.config.run_id
            and not self._not_resumable({**state, "finished": False})
        )

    def _from_previous(self) -> tuple[Path, dict[str, Any]] | None:
        """--resume with nothing here to continue: the newest unfinished run of this job set
        aside in previous/, moved back; None when there is none."""
        for where, (path, state) in checkpoint_files.set_aside_runs(self.directory):
            if not state["finished"] and not self._not_resumable({**state, "run_id": self.config.run_id}):
                moved = checkpoint_files.move_back(where, self.directory)
                log.info(
                    "--resume: moved %d file(s) of run %s back from %s",
                    moved,
                    state.get("run_id") or "without an id",
                    where,
                )
                return self.directory / path.relative_to(where), state
        return None

    def _not_resumable(self, state: dict[str, Any]) -> str:
        """Why `state` is not continued by this run ('' when it is)."""
        defaults = {"shards": 1, "shard": 0}  # identity keys of a sharded PS (app.ps.sharding.slices)
        expected = {**defaults, **self.identity}
        mismatch = {k: state.get(k, defaults.get(k)) for k, v in expected.items() if state.get(k, defaults.get(k)) != v}
        if mismatch:
            return f"it is of another job ({mismatch})"
        if state["finished"]:
            return "it ended a finished run"
        run = state.get("run_id", "")
        if self.config.run_id and run != self.config.run_id and not self.config.resume:
            return (
                f"it is of run {run or 'without an id'}, this is run {self.config.run_id} "
                "(--resume, make up RESUME=1, continues it)"
            )
        return ""

    def _start_fresh(self, path: Path, state: dict[str, Any], why: str) -> None:
        label = state.get("run_id") or f"version-{state['version']}"
        moved = checkpoint_files.set_aside(self.directory, label)
        where = f"; its files moved to {moved[0]}" if moved else ""
        log.info(
            "not resuming from %s (version %d): %s; starting a new run at version 0%s",
            path.name,
            state["version"],
            why,
            where,
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
        if state["version"] == 0 or (state["version"] == self.saved_version and not always):
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
        self.saved_version, self.saved_run = state["version"], self.config.run_id
        log.info("checkpoint %s (%s, %.2f s)", path.name, why, seconds)
        self.metrics.write("checkpoint", state["version"], file=path.name, why=why, seconds=round(seconds, 3))

    def final(self, model: dict[str, torch.Tensor] | None = None) -> None:
        """final.pt, then the last checkpoint (marked finished); OSError naming the file
        if one fails. A finished checkpoint therefore always has its final.pt; if only
        final.pt was written, a restart resumes the (unfinished) run and writes both.

        `model`: the whole model's state dict, for a sharded PS whose own state is a slice."""
        state = self._state()
        final = self.directory / "final.pt"
        saved = state
        if model is not None:
            saved = {k: v for k, v in state.items() if k not in ("vector", "part", "optimizer")}
            saved["model"] = model
        with self._lock:
            try:
                checkpoint_files.save_atomically(saved, final)
            except OSError as error:
                raise OSError(
                    f"{final} not written ({error.strerror or error}); no checkpoint was marked finished"
                ) from None
            log.info("saved %s (version %d)", final, state["version"])
            checkpoint_files.save(state, self.directory)
