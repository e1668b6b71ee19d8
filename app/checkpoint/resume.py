"""Where a run starts: the resume decision over a checkpoint directory.

A run continues the newest good checkpoint of an unfinished run of its job when that is its own
run (the same --run_id: a restarted PS), or --resume says so, or no run id was given. Otherwise
it is a new run: it starts at version 0 and the files it found are set aside
(`files.set_aside`, one log line saying where), so they are neither resumed nor pruned by its
checkpoints. With --resume and nothing to continue here, an unfinished run set aside earlier
(`previous/`) is moved back and continued: the one of this run id if there is one (`up --resume
RUN_ID`: another run's files here are set aside for it), else the newest. A run id that already
finished (a checkpoint marked finished, or its final.pt: written first, it ends the run even when
that checkpoint could not be written after it) has nothing to do: its final.pt stays.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

from app.checkpoint import files as checkpoint_files
from app.config import Config

log = logging.getLogger("app.checkpoint")

Found = tuple[Path, dict[str, Any]]  # a checkpoint file and its state


class Decision(NamedTuple):
    """What a run starts from: `found` (None: version 0), or nothing to do at all when
    `finished` (one line for the log: this run id has finished already)."""

    found: Found | None = None
    finished: str = ""


def decide(directory: Path, config: Config, identity: dict[str, Any]) -> Decision:
    """The start of a run of the job `identity` in `directory` (files set aside or moved back
    on the way, each said in one line)."""
    return _Runs(directory, config, identity).decide()


class _Runs:
    """The runs a checkpoint directory holds, as seen by a run of `config`'s job."""

    def __init__(self, directory: Path, config: Config, identity: dict[str, Any]) -> None:
        self.directory, self.config, self.identity = directory, config, identity
        self.final: dict[str, Any] | None = None  # what final.pt says of its run

    def decide(self) -> Decision:
        found = checkpoint_files.newest_good(self.directory)
        self.final = checkpoint_files.final_state(self.directory)
        for path, state in ([found] if found is not None else []) + self._final_as_found():
            if self._finished_here(state):
                return Decision(
                    finished=f"run {self.config.run_id} already finished at version {state['version']} "
                    f"({path.name}; {self.directory / 'final.pt'} kept): nothing to do"
                )
        if found is not None and self._not_resumable(found[1]):
            self._start_fresh(*found, self._not_resumable(found[1]))
            found, self.final = None, None
        if found is not None and self._own_run_set_aside(found[1]):
            self._set_aside_for_own(*found)
            found, self.final = None, None
        if found is None and self.config.resume:
            found = self._from_previous()
        return Decision(found)

    def _own_run_set_aside(self, state: dict[str, Any]) -> bool:
        """--resume of a run id whose checkpoints were set aside, while another run's are here
        (`state`): that run is the one continued (`up --resume RUN_ID`)."""
        own = self.config.run_id
        return bool(self.config.resume and own and state.get("run_id") != own and self._resumable_set_aside(own))

    def _set_aside_for_own(self, path: Path, state: dict[str, Any]) -> None:
        label = state.get("run_id") or f"version-{state['version']}"
        moved = checkpoint_files.set_aside(self.directory, label)
        log.info(
            "--resume of run %s: the files of run %s here (%s, version %d) moved to %s, to continue %s",
            self.config.run_id,
            state.get("run_id") or "without an id",
            path.name,
            state["version"],
            moved[0] if moved else self.directory,
            self.config.run_id,
        )

    def _final_as_found(self) -> list[Found]:
        """final.pt as a finished checkpoint of its run (its values other than the tensors'):
        a run whose final.pt was written has ended, even when the checkpoint marked finished
        after it could not be written (a full disk) and an older one is the newest."""
        if self.final is None:
            return []
        return [(self.directory / "final.pt", {"finished": True, **self.final})]

    def _ended_with_final(self, state: dict[str, Any]) -> bool:
        """final.pt holds the end of the run `state` is a checkpoint of (same run id, same job,
        not older): that run is not continued from `state`."""
        final = self.final
        return bool(
            final is not None
            and final.get("run_id", "") == state.get("run_id", "")
            and final["version"] >= state["version"]
            and not self._other_job(final)
        )

    def _finished_here(self, state: dict[str, Any]) -> bool:
        """This run (same non-empty run id, same job) ended: a restart of its PS has nothing to do."""
        return bool(
            state["finished"]
            and self.config.run_id
            and state.get("run_id") == self.config.run_id
            and not self._other_job(state)
        )

    def _resumable_set_aside(self, run_id: str = "") -> list[tuple[Path, Found]]:
        """The unfinished runs of this job set aside in previous/, newest first (of `run_id` alone
        when given)."""
        runs = []
        for where, (path, state) in checkpoint_files.set_aside_runs(self.directory):
            ended = checkpoint_files.final_state(where)
            if ended is not None and ended.get("run_id", "") == state.get("run_id", ""):
                continue  # that run wrote its final.pt: it ended
            if run_id and state.get("run_id") != run_id:
                continue
            if not state["finished"] and not self._not_resumable({**state, "run_id": self.config.run_id}):
                runs.append((where, (path, state)))
        return runs

    def _from_previous(self) -> Found | None:
        """--resume with nothing here to continue: the run of this run id set aside in previous/
        (`up --resume RUN_ID`), else the newest unfinished run of this job there, moved back;
        None when there is none."""
        chosen = self._resumable_set_aside(self.config.run_id) if self.config.run_id else []
        for where, (path, state) in (chosen or self._resumable_set_aside())[:1]:
            moved = checkpoint_files.move_back(where, self.directory)
            log.info(
                "--resume: moved %d file(s) of run %s back from %s",
                moved,
                state.get("run_id") or "without an id",
                where,
            )
            return self.directory / path.relative_to(where), state
        return None

    def _other_job(self, state: dict[str, Any]) -> str:
        """'it is of another job (...)' when `state`'s identity is not this job's, else ''."""
        defaults = {"shards": 1, "shard": 0}  # identity keys of a sharded PS (app.ps.sharding.slices)
        expected = {**defaults, **self.identity}
        mismatch = {k: state.get(k, defaults.get(k)) for k, v in expected.items() if state.get(k, defaults.get(k)) != v}
        return f"it is of another job ({mismatch})" if mismatch else ""

    def _not_resumable(self, state: dict[str, Any]) -> str:
        """Why `state` is not continued by this run ('' when it is)."""
        if self._other_job(state):
            return self._other_job(state)
        if state["finished"]:
            return "it ended a finished run"
        if self._ended_with_final(state):
            return f"its run ended at version {self.final['version']} (final.pt)"  # type: ignore[index]
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
