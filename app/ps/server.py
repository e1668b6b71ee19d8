"""The Parameter Server's state machine: global model, SGD under a lock, version, staleness, roster.

`ParameterServer` is plain Python (tested without RPC); the arithmetic of a push
(wire format, NaN/inf check, mean, SGD direction) is app.ps.update; the RPC entry points
workers call are in app.ps.rpc, the PS process in app.ps.process.
Workers join, pull, push and report; the PS calls a worker only to ping it
(app.ps.members.liveness).

The strategy's policy (app.ps.policies: async, ssp or sync) decides when a push is
applied and when its reply goes out (`submit` returns a future; `rpc_push` is
`async_execution`, so a reply held back ties up no RPC thread):

- async: applied at once, answered at once (asynchronous SGD).
- ssp:   applied at once; answered once the pusher is at most `staleness`
         pushes ahead of the slowest rank still training (Ho et al. 2013).
- sync:  held until every rank still training pushed once; their average is
         applied as one update and every pusher gets the same answer.

A sharded PS (app.ps.sharding.slices) runs one ParameterServer per process over a slice
`part` of the state vector: pushes, replies and checkpoints are that slice.

A push the PS will not apply is answered with a `Refusal` value, never an
exception (RPC would carry an exception set on the future back as a plain
value): `stale` (a newer process of the rank replaced the pusher: it exits)
or `nonfinite` (NaN/inf in the push: nothing applied, the worker skips the
batch).

Every piece of shared state (the sum of a round, the held replies, the
roster) changes under the one lock; futures are completed after it is
released, so sending replies never holds up a push.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.futures import Future

from app.checkpoint.files import cpu_copy
from app.config import Config
from app.contract import PS_STRATEGIES, strategy_of, worker_name
from app.exchange import ps_end as exchange
from app.exchange.notes import Note
from app.exchange.ps_end import SharedExchange
from app.exchange.wire import WIRE_DTYPES, Joined, Refusal, Refused, Reply, all_finite, to_float32, wire_size
from app.ps.early import Ahead
from app.ps.members.roster import ABSENT, FINISHED, LIVE, Roster, StaleIncarnation
from app.ps.policies import Held, policy_for
from app.ps.replies import ReplyBuffers
from app.ps.tally import Tally
from app.ps.update import sgd_direction
from app.training.flat import FlatModel

log = logging.getLogger("app.ps")


class ParameterServer:
    """Owns the global state vector [params | buffers] and applies pushed gradients.

    A push is `[grads | buffers]` as one flat tensor: SGD steps the parameters,
    and the buffers (BatchNorm running stats) replace the global ones. Every
    worker starts each forward from the buffers it received, so the running
    stats form one moving average over all workers' batches, delayed like the
    parameters. The roster (who trains, and how far each rank got) changes
    under the same lock, so a checkpoint's progress matches its version.
    """

    @classmethod
    def from_config(
        cls,
        config: Config,
        model: nn.Module,
        part: tuple[int, int] | None,
        who: str,
        on_finish: Callable[[int], None] | None = None,
    ) -> ParameterServer:
        """The PS process `who` (the main PS, or a shard serving `part` of the state) of the job
        `config` describes, over `model`'s state, with its shared-memory segment where the
        exchange can have one (app.exchange.ps_end); `on_finish(rank)` after a rank finished."""
        return cls(
            model,
            config.lr,
            config.momentum,
            config.num_trainers,
            config.join_timeout,
            strategy=config.strategy,
            staleness=config.staleness,
            staleness_lr=config.staleness_lr,
            part=part,
            weight_decay=config.weight_decay,
            max_trainers=config.max_trainers,
            shared=exchange.for_config(config, model, part, who),
            run_id=config.run_id,
            on_finish=on_finish,
            overlap=config.overlap,
        )

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        momentum: float,
        num_trainers: int,
        join_timeout: float = float("inf"),
        clock: Callable[[], float] = time.monotonic,
        strategy: str = "async",
        staleness: int = 0,
        staleness_lr: bool = False,
        part: tuple[int, int] | None = None,
        weight_decay: float = 0.0,
        max_trainers: int = 0,
        shared: SharedExchange | None = None,
        run_id: str = "",
        on_finish: Callable[[int], None] | None = None,
        overlap: bool = False,
    ) -> None:
        self.kind = strategy_of(strategy)
        if not self.kind.has_ps:
            raise ValueError(f"strategy {strategy!r}: the PS runs {', '.join(PS_STRATEGIES)}")
        self.strategy, self.bound, self.staleness_lr, self.lr = strategy, staleness, staleness_lr, lr
        self._serve(model, part)
        self._param = nn.Parameter(self.state[: self.num_params])  # shares storage with the model
        self.optimizer = torch.optim.SGD([self._param], lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.num_trainers = num_trainers
        # Ranks 1..num_trainers from the start; up to max_trainers when the job is scaled up.
        self.roster = Roster(range(1, num_trainers + 1), join_timeout, clock, max_rank=max_trainers)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._events = 0  # joins, finishes, drops: they wake `wait`
        self._wake_at = 0
        self.clock = clock
        # Called (outside the lock) when a dropped process calls again: app.ps.members.liveness logs it.
        self.on_back: Callable[[int, str], None] = lambda rank, name: None
        # Called (outside the lock) when a process left the job for good (scaled down):
        # app.ps.members.liveness records it.
        self.on_leave: Callable[[int, str], None] = lambda rank, name: None
        # Called (outside the lock, before the finishing worker gets its answer) after a rank
        # finished: the PS process checkpoints then, so a finish outlives a PS crash.
        self.on_finish: Callable[[int], None] = on_finish or (lambda rank: None)
        # The run this PS serves (--run_id): a checkpoint of another run restores no finish.
        self.run_id = run_id
        self._finishing = 0  # finishes whose on_finish runs: the job is not done before they are
        self.held: dict[int, Held] = {}  # rank -> its push whose reply waits
        self.replies = ReplyBuffers(self.size, shared)  # two per rank, used in turn (app.ps.replies)
        self.shared = shared
        # Partitions applied ahead of a push, as a worker's backward finishes them (app.ps.early).
        self.parts = shared.parts if shared is not None and shared.parts and not self.sliced else None
        self._taken: dict[int, int] = {}  # rank -> the backward of the push of its process last taken
        # When a push is applied and its reply goes (app.ps.policies): async's, ssp's or sync's;
        # `overlap`: the job's workers run --overlap.
        self.policy = policy_for(self.kind, self, overlap)
        self._start_counts()

    def _serve(self, model: nn.Module, part: tuple[int, int] | None) -> None:
        """`state` is what this process serves: the whole vector, or (a PS shard,
        app.ps.sharding.slices) the slice `part` of it, a view: pushes carry and replies hold
        exactly its values."""
        self._model = model
        self._flat = FlatModel(model, with_grads=False)
        start, end = (0, self._flat.size) if part is None else part
        if not 0 <= start <= end <= self._flat.size:
            raise ValueError(f"part {part} is not a slice of the model's {self._flat.size} values")
        self.part, self.sliced = (start, end), part is not None and (start, end) != (0, self._flat.size)
        self.state = self._flat.vector[start:end] if self.sliced else self._flat.vector
        self.size = end - start
        # The parameter values in the slice (it may hold buffers only, or straddle both).
        self.num_params = min(max(self._flat.num_params - start, 0), self.size)

    def _start_counts(self) -> None:
        """Version, pushes and samples: none yet (a checkpoint may restore them)."""
        self.tally = Tally()
        self.first_join: float | None = None  # clock time of the first join
        self.all_joined: float | None = None  # clock time every rank had joined (or finished)
        self.last_applied: float | None = None  # clock time of the last update applied
        self.version = 0

    @property
    def model(self) -> nn.Module:
        """The model, its parameters and buffers views of the state. A push that moves the state
        into a reply buffer does not re-point them (a hundred views a step); reading the model
        does."""
        self._follow_state()
        return self._model

    @property
    def flat(self) -> FlatModel:
        """The model's flat views (app.training.flat), pointed at the state."""
        self._follow_state()
        return self._flat

    def _follow_state(self) -> None:
        if not self.sliced and self._flat.vector is not self.state:
            self._flat.adopt(self.state)

    def pull(self, rank: int) -> tuple[torch.Tensor, int]:
        """A copy of the state vector and its version."""
        with self._lock:
            return self.state.clone(), self.version

    def join(self, rank: int, name: str) -> Joined:
        """`name` becomes rank's process: the state, its version and where the rank resumes."""
        with self._lock:
            # sync: a rank the open round was not waiting for (a rank added by scaling up, or one
            # that had left or was dropped) is counted from the next round on; a rank the round
            # waits for (one of the job's first ranks, joining late) is counted in it
            waited_for = rank in self.training_ranks()
            self._keep_held_message(rank)
            self._forget_ahead(rank)
            self._taken[rank] = -1  # a new process counts its backwards from 0
            member = self.roster.join(rank, name)
            member.last_seen = self.clock()
            open_round = self.kind.rounds and self.held and rank not in self.held and not waited_for
            member.round_from = self.version + 1 if open_round else 0
            self.first_join = self.first_join or self.clock()
            if self.all_joined is None and all(m.joins or m.state == FINISHED for m in self.roster.members.values()):
                self.all_joined = self.clock()
            self._event()
            return Joined(self.state.clone(), self.version, member.progress(), life=member.joins)

    def _keep_held_message(self, rank: int) -> None:
        """A new process of `rank` joins while its old one's sync push is held: that push is
        still in the rank's push slot, which the new process is about to overwrite; the
        round keeps a copy. Called under the lock."""
        held = self.held.get(rank)
        if held is not None and held.message is not None and self.shared is not None:
            if self.shared.holds(held.message):
                self.held[rank] = held._replace(message=held.message.clone())

    def push(
        self,
        rank: int,
        message: torch.Tensor,
        pulled_version: int,
        name: str = "",
        epoch: int = 1,
        batch: int = 0,
        samples: int = 0,
        staleness: int | None = None,
    ) -> Reply | Refusal:
        """`submit`, waiting for the reply (tests, and callers that may block)."""
        return self.submit(rank, message, pulled_version, name, epoch, batch, samples, staleness).wait()

    def submit(
        self,
        rank: int,
        message: torch.Tensor,
        pulled_version: int,
        name: str = "",
        epoch: int = 1,
        batch: int = 0,
        samples: int = 0,
        staleness: int | None = None,
        backward: int | None = None,
        noted: bool = False,
        finite: bool = False,
    ) -> Future:
        """Take one worker's `[grads | buffers]`; a future of its Reply (or Refusal).

        `epoch` and `batch` are the worker's progress once this push is applied;
        `samples` the batch's size. A reply's vector is one of rank's (or the
        round's) two reply buffers, not a fresh copy: it stays unchanged until
        rank's next-but-one push. `staleness`: the push's staleness as the main
        PS computed it (a PS shard, app.ps.sharding.slices); by default this PS's own.
        `backward`: which of the worker's backwards the gradient comes from, where it notes
        partitions ahead (app.ps.early), and `noted`: it noted this one's. `finite`: the
        worker found every value finite where it computed them (a GPU worker's flags,
        app.exchange.slot_copies): not checked again here.
        """
        message = self._check(rank, message)
        name = name or worker_name(rank)
        future: Future = Future()
        ahead = self._take_ahead(rank, backward)
        if not noted:
            ahead, backward = None, None
        checked = self.policy.checked(rank, backward, ahead)
        finite = finite or self._finite(message, checked)
        with self._lock:
            try:
                readmitted = self.roster.seen(rank, name)
            except StaleIncarnation as error:
                log.info("push not applied: %s", error)
                future.set_result(Refusal(Refused.STALE, str(error)))
                return future
            if not finite:
                refusal, ready = self._refuse_nonfinite(rank, name), []
            else:
                self.tally.samples += samples
                self.tally.ahead_checked += len(checked)
                if staleness is None:
                    staleness = self.version - pulled_version
                ready = self.policy.take(rank, message, future, epoch, batch, staleness, ahead, backward)
            if readmitted:
                self._changed.notify_all()
        if not finite:
            future.set_result(refusal)
        _complete(ready)
        if readmitted:
            self.on_back(rank, name)
        return future

    def _check(self, rank: int, message: torch.Tensor) -> torch.Tensor:
        """The pushed message as float32; ValueError when it is not this model's.

        A 16-bit message (--compress) carries the gradients in 16 bits and the
        buffers in float32, each float32 as two 16-bit values (app.worker.compress.Compressor)."""
        expected = wire_size(message.dtype, self.num_params, self.size)
        if message.numel() != expected or message.dtype not in WIRE_DTYPES:
            holds = f"values {self.part[0]}..{self.part[1]} of the model" if self.sliced else "the model"
            raise ValueError(
                f"worker{rank} pushed {message.numel()} {message.dtype} values; "
                f"{holds} has {self.size} float32 values ({expected} as sent compressed)"
            )
        return to_float32(message, self.num_params)

    def _refuse_nonfinite(self, rank: int, name: str) -> Refusal:
        """Count a push holding NaN or inf (nothing of it is applied); warn once per worker.
        Called under the lock."""
        self.tally.refused[rank] += 1
        if self.tally.refused[rank] == 1:
            log.warning(
                "%s pushed non-finite values (NaN or inf); refused, the model is unchanged "
                "(further refusals of it are counted, not logged)",
                name,
            )
        return Refusal(Refused.NONFINITE, f"{name} pushed non-finite values (NaN or inf); the push was refused")

    def scale_for(self, staleness: int) -> float:
        """Zhang et al. 2016: a push `staleness` updates late counts 1 / staleness as much
        (its gradient is scaled, so momentum carries the scaled gradient too)."""
        return 1.0 / max(1, staleness) if self.staleness_lr else 1.0

    def step(self, message: torch.Tensor, scale: float = 1.0, into: torch.Tensor | None = None) -> None:
        """One SGD step with `message`'s grads times `scale`; its buffers become the global ones.

        `into` (a reply buffer no reply in flight uses; it may be the state itself): the new
        state is written there and becomes the state (the model's views and the optimizer's
        parameter move to it), so that reply needs no copy of the state. The step is
        torch.optim.SGD's, value for value, and its momentum buffer stays the optimizer's."""
        n = self.num_params
        grads = message[:n] if scale == 1.0 else message[:n] * scale
        if into is None:
            self._param.grad = grads
            self.optimizer.step()
            self._param.grad = None
            self.state[n:].copy_(message[n:])
        else:
            torch.add(self.state[:n], sgd_direction(self.optimizer, self._param, grads), alpha=-self.lr, out=into[:n])
            into[n:].copy_(message[n:])
        self.adopt(into)

    def adopt(self, into: torch.Tensor | None) -> None:
        """`into` (when given) holds the new state: it becomes the state (the optimizer's
        parameter moves to it; the model's views follow when the model is read). One update more."""
        if into is not None:
            self.state = into
            self._param.data = into[: self.num_params]
        self.version += 1
        self.last_applied = self.clock()
        if self.version >= self._wake_at:
            self._changed.notify_all()

    def count_push(self, rank: int, epoch: int, batch: int, staleness: int) -> None:
        self.roster.record_push(rank, epoch, batch)
        self.tally.count(staleness)

    def hold(self, rank: int, held: Held) -> None:
        old = self.held.pop(rank, None)
        if old is not None:  # its earlier process died waiting; this one replaces it
            old.future.set_result(Refusal(Refused.STALE, f"worker{rank} pushed again from a new process; exiting"))
        self.held[rank] = held

    def training_ranks(self) -> list[int]:
        """Ranks ssp and sync wait for: live ones, and those yet to join within join_timeout
        (not finished, not dropped)."""
        missing = {m.rank for m in self.roster.missing()}
        return [
            m.rank
            for m in self.roster.members.values()
            if (m.state == LIVE and m.round_from <= self.version) or (m.state == ABSENT and m.rank not in missing)
        ]

    def shard_of(self, rank: int) -> tuple[int, int]:
        """(index, count): rank's share of an epoch's data among the ranks training now (those
        ssp and sync wait for, and rank itself), for a job that may be scaled while it runs."""
        with self._lock:
            ranks = sorted({*self.training_ranks(), *(m.rank for m in self.roster.live()), rank})
            return ranks.index(rank), len(ranks)

    def lead(self, rank: int) -> int:
        """How many pushes rank is ahead of the slowest rank still training."""
        pushes = [self.roster.members[r].pushes for r in self.training_ranks()]
        return self.roster.members[rank].pushes - min(pushes) if pushes else 0

    def ahead(self, note: Note) -> None:
        """A partition of rank's next push is in its slot (app.ps.early): fold it into the
        round (sync), or build it in the rank's next reply buffer (async, plain SGD). A note
        of a push already taken, of a push the policy does not take ahead yet, of another process
        of the rank (a replaced one: its life is not the rank's last join), or of the last
        partition (the buffers go with the push) is passed over."""
        if self.parts is None or not 0 <= note.partition < len(self.parts) - 1 or self.shared is None:
            return
        message = self.shared.push(note.rank, note.slot, "float32", self.size)
        with self._lock:
            member = self.roster.members.get(note.rank)
            if member is None or member.joins != note.life or not self.policy.admits(note, self._taken.get(note.rank)):
                return
            self.policy.note(note, message)

    def _take_ahead(self, rank: int, backward: int | None) -> Ahead | None:
        """What was built ahead of rank's push from `backward` (None: nothing, or it notes none);
        notes of this backward are passed over from now on."""
        if backward is None:
            return None
        with self._lock:
            self._taken[rank] = backward
            return self.policy.take_ahead(rank, backward)

    def _finite(self, message: torch.Tensor, checked: set[int]) -> bool:
        """No NaN or inf in `message`; partitions `checked` are not read again (noted ahead: their
        worker checked each where it wrote it before noting it, app.exchange.early_push)."""
        if not checked:
            return all_finite(message)
        n = self.num_params
        parts = self.parts or [(0, self.size)]
        rest = [(s, min(e, n)) for j, (s, e) in enumerate(parts) if j not in checked] + [(n, self.size)]
        return all(all_finite(message[s:e]) for s, e in rest if e > s)

    def _forget_ahead(self, rank: int) -> None:
        """A new process of `rank`, or the rank left: nothing built ahead of its old push counts.
        Called under the lock."""
        self.policy.forget(rank)

    def momentum_or_decay(self) -> bool:
        group = self.optimizer.param_groups[0]
        return bool(group["momentum"] or group["weight_decay"])

    def finish(self, rank: int, pushes: int, name: str = "") -> Refusal | None:
        """A worker has run all its epochs; recorded durably (on_finish) before it returns.
        A Refusal when a newer process replaced `name`."""
        with self._lock:
            try:
                self.roster.finish(rank, name or worker_name(rank))
            except StaleIncarnation as error:
                return Refusal(Refused.STALE, str(error))
            self._finishing += 1
            counts = self.roster.counts()
            ready = self._unblock()
        _complete(ready)
        log.info("%s finished after %d pushes (%s)", name or worker_name(rank), pushes, counts)
        try:
            self.on_finish(rank)
        finally:
            with self._lock:
                self._finishing -= 1
                self._event()
        return None

    def leave(self, rank: int, pushes: int, name: str = "") -> Refusal | None:
        """`name` leaves the job for good (scaled down, after its last push was answered): nobody
        waits for its rank any more (a sync round shrinks, ssp's bound follows the others).
        A Refusal when a newer process replaced `name`."""
        name = name or worker_name(rank)
        with self._lock:
            try:
                self.roster.leave(rank, name)
            except StaleIncarnation as error:
                return Refusal(Refused.STALE, str(error))
            ready = self._let_go(rank)
            self._event()
            counts = self.roster.counts()
        _complete(ready)
        log.info("%s left after %d pushes (%s)", name, pushes, counts)
        self.on_leave(rank, name)
        return None

    def live_count(self) -> int:
        """How many workers train now."""
        with self._lock:
            return len(self.roster.live())

    def drop(self, rank: int, name: str) -> bool:
        """Stop waiting for `name`; False when it is not rank's live process (any more).

        Its held push is answered with the current state (ssp: it was applied; sync:
        it was not, and the round goes on without it): if the process is alive after
        all, it continues, and its next call readmits it."""
        with self._lock:
            if not self.roster.drop(rank, name):
                return False
            ready = self._let_go(rank)
            self._event()
        _complete(ready)
        return True

    def _let_go(self, rank: int) -> list[tuple[Future, Reply]]:
        """Nobody waits for `rank` any more: what it had built ahead is forgotten, and its push
        held and not answered yet goes back with the state as it is (ssp: it was applied; sync:
        it was not, and the round goes on without it). Called under the lock."""
        held = self.held.pop(rank, None)
        self._forget_ahead(rank)
        ready = self._unblock()
        if held is not None:
            vector = self.replies.take(rank).copy_(self.state)
            ready.append((held.future, Reply(vector, self.version, held.staleness, 0)))
        return ready

    def frozen(self, limit: float) -> list[tuple[int, str, float]]:
        """ssp/sync: (rank, name, seconds quiet) of live ranks that have not called for
        `limit` seconds and are not waiting for an answer to a push (async waits for no one)."""
        if not self.kind.waits:
            return []
        with self._lock:
            now = self.clock()
            return [
                (m.rank, m.name, now - m.last_seen)
                for m in self.roster.live()
                if m.rank not in self.held and now - m.last_seen >= limit
            ]

    def training_seconds(self) -> float | None:
        """From every rank joined (or, if one never did, the first join) to the last update."""
        with self._lock:
            start = self.all_joined if self.all_joined is not None else self.first_join
            if start is None or self.last_applied is None:
                return None
            return max(0.0, self.last_applied - start)

    def unblock(self) -> None:
        """Answer held pushes that no longer wait for anyone (a rank past join_timeout);
        the PS process calls it every tick."""
        with self._lock:
            ready = self._unblock()
        _complete(ready)

    def _unblock(self) -> list[tuple[Future, Reply]]:
        """A rank stopped training: the others may no longer have to wait for it."""
        return self.policy.unblock()

    def live_name(self, rank: int) -> str | None:
        """The RPC name of rank's live process, if one is live."""
        with self._lock:
            if rank not in self.roster.members and 1 <= rank <= self.roster.max_rank:
                return None  # a rank of a job scaled up, not joined yet
            member = self.roster[rank]
            return member.name if member.state == LIVE else None

    def live_members(self) -> list[tuple[int, str, float]]:
        """(rank, name, last call time) of every live process."""
        with self._lock:
            return [(m.rank, m.name, m.last_seen) for m in self.roster.live()]

    def progress(self) -> tuple[int, int, int, int, int]:
        """(version, samples, pushes applied, their staleness summed, live workers), read at once."""
        with self._lock:
            t = self.tally
            return self.version, t.samples, t.applied, t.staleness_sum, len(self.roster.live())

    def counts(self) -> str:
        with self._lock:
            return self.roster.counts()

    def _event(self) -> None:
        self._events += 1
        self._changed.notify_all()

    @property
    def pushes(self) -> dict[int, int]:
        return {r: m.pushes for r, m in self.roster.members.items() if m.pushes}

    @property
    def finished(self) -> dict[int, int]:
        return {r: m.pushes for r, m in self.roster.members.items() if m.state == FINISHED}

    @property
    def all_finished(self) -> bool:
        with self._lock:
            return self.roster.all_finished

    def done(self) -> bool:
        """Every rank finished, or no one trains and the missing ones are past join_timeout."""
        with self._lock:
            return self._finishing == 0 and self.roster.done()

    def wait(self, until_version: int, timeout: float) -> None:
        """Block until the version reaches `until_version`, a worker joins, finishes or
        is dropped, or timeout."""
        with self._changed:
            events, self._wake_at = self._events, until_version
            self._changed.wait_for(
                lambda: (
                    self._events != events
                    or self.version >= until_version
                    or (self.roster.all_finished and not self._finishing)
                ),
                timeout,
            )

    def snapshot(self) -> tuple[torch.Tensor, int]:
        return self.pull(rank=0)

    def checkpoint(self) -> dict[str, Any]:
        """Model, optimizer, version and each rank's progress, copied under the lock.

        A shard's holds its slice as `vector` (with `part`), and no `model`'s values."""
        with self._lock:
            model = {} if self.sliced else {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            state = {
                "version": self.version,
                "model": model,
                "optimizer": cpu_copy(self.optimizer.state_dict()),
                "progress": self.roster.state(),
                "pushes": self.pushes,
                "finished": self.roster.all_finished,
            }
            if self.sliced:
                state.update(vector=self.state.clone(), part=list(self.part))
            return state

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint (written by `checkpoint`)."""
        with self._lock:
            if self.sliced:
                if list(state.get("part", [])) != list(self.part):
                    raise ValueError(f"the checkpoint holds values {state.get('part')}, this shard {list(self.part)}")
                self.state.copy_(state["vector"])
            else:
                self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.version = int(state["version"])
            self.roster.restore(state["progress"], same_run=state.get("run_id", "") == self.run_id)

    def stats(self) -> dict[str, Any]:
        """The `end` record's counts (app.ps.tally)."""
        with self._lock:
            return self.tally.fields(self.pushes, ahead=bool(self.parts))


def _complete(ready: list[tuple[Future, Reply]]) -> None:
    """Send held replies (outside the lock: completing a future runs RPC's callbacks)."""
    for future, reply in ready:
        future.set_result(reply)
