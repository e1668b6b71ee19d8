"""What a PS process serves: the state vector [params | buffers] (the whole model's, or a PS
shard's slice of it), its optimizer (app.ps.optim: the recipe's, SGD by default) and its version;
the step a push makes, value for value torch.optim's, at the rate the schedule gives the version
(app/recipes.py lr_factor), its gradient clipped to train.clip_grad_norm by the norm the worker
sent; a copy, a checkpoint and a restore of itself.

A push is `[grads | buffers]` as one flat tensor: SGD steps the parameters, and the buffers
(BatchNorm running stats) replace the global ones. Every worker starts each forward from the
buffers it received, so the running stats form one moving average over all workers' batches,
delayed like the parameters.

No lock of its own: app.ps.server calls it under its lock, and the strategy's policy
(app.ps.policies) steps it there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from app.checkpoint.files import cpu_copy
from app.contract import ENTRY_POINT
from app.exchange.progress import Progress
from app.exchange.wire import WIRE_DTYPES, all_finite, to_float32, wire_size
from app.ps import optim
from app.ps.plateau import Plateau
from app.ps.sgd import SGD
from app.ps.user_schedule import UserSchedule
from app.recipes import Spec, lr_factor, planned_updates, resolve_optimizer
from app.training.flat import FlatModel

log = logging.getLogger("app.ps")

# torch.nn.utils.clip_grad_norm_'s: the gradient times max_norm / (norm + 1e-6), at most 1.
CLIP_EPS = 1e-6


class Plan(NamedTuple):
    """What a run's length is planned from (app/recipes.py planned_updates), besides the batches
    of an epoch that the pushes say."""

    strategy: str = "async"
    epochs: int = 1
    workers: int = 1
    max_steps: int = 0
    local_steps: int = 1  # diloco, diloco_async: a worker's batches a push


@dataclass(frozen=True)
class StateConfig:
    """The optimizer's settings and which values this PS process serves."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    staleness_lr: bool = False  # a push `staleness` updates late counts 1 / staleness as much
    part: tuple[int, int] | None = None  # a PS shard (app.ps.sharding.slices): values start..end
    optimizer: Spec = field(default_factory=lambda: {"name": "sgd"})
    schedule: Spec = field(default_factory=lambda: {"name": "constant"})
    clip_grad_norm: float = 0.0
    plan: Plan = Plan()
    metrics: str = "accuracy"  # the evaluation a plateau schedule follows (its headline)


class State:
    """The values this PS process serves, the optimizer that steps them, and their version.

    `vector` is the whole state, or (a PS shard) the slice `part` of it, a view: pushes carry
    and replies hold exactly its values. Unsliced, a step may write the new state into a reply
    buffer and make that buffer the state (`adopt`): the model's views follow when it is read."""

    def __init__(self, model: nn.Module, config: StateConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self._model = model
        self._flat = FlatModel(model, with_grads=False)
        start, end = (0, self._flat.size) if config.part is None else config.part
        if not 0 <= start <= end <= self._flat.size:
            raise ValueError(f"part {config.part} is not a slice of the model's {self._flat.size} values")
        self.part = (start, end)
        self.sliced = config.part is not None and self.part != (0, self._flat.size)
        self.vector = self._flat.vector[start:end] if self.sliced else self._flat.vector
        self.size = end - start
        # The parameter values in the slice (it may hold buffers only, or straddle both).
        self.num_params = min(max(self._flat.num_params - start, 0), self.size)
        recipe = resolve_optimizer(config.optimizer, config.lr, config.momentum, config.weight_decay)
        self.base_lr = float(recipe.kwargs["lr"])
        self.param = nn.Parameter(self.vector[: self.num_params])  # shares storage with the model
        self.optimizer = optim.build(self.param, model, (start, start + self.num_params), recipe)
        self.version = 0
        self.total: int | None = None  # the run's planned updates, once a push said its epoch's batches
        self._planned = False  # this process has planned the run (a checkpoint's total may differ)
        self.lr = self.base_lr
        plateau = config.schedule["name"] == "plateau"
        self.plateau = Plateau(config.schedule, config.metrics, self.base_lr) if plateau else None
        users = ENTRY_POINT.match(config.schedule["name"]) is not None
        self.user_schedule = UserSchedule(config.schedule) if users else None
        self._set_lr()
        self.last_applied: float | None = None  # clock time of the last update applied
        # A streamed step's partitions in the forward's order, as the exchange cuts them for its
        # workers (app.ps.server sets them; none: no step is streamed), and what is left of the
        # one under way (`finish`).
        self.parts: list[tuple[int, int]] = []
        self._rest: Iterator[None] | None = None

    @property
    def model(self) -> nn.Module:
        """The model, its parameters and buffers views of the state. A step that moves the state
        into a reply buffer does not re-point them (a hundred views a step); reading the model
        does."""
        self._follow()
        return self._model

    @property
    def flat(self) -> FlatModel:
        """The model's flat views (app.training.flat), pointed at the state."""
        self._follow()
        return self._flat

    def _follow(self) -> None:
        self.finish()
        if not self.sliced and self._flat.vector is not self.vector:
            self._flat.adopt(self.vector)

    def copy(self) -> tuple[torch.Tensor, int]:
        """A copy of the state vector, and its version."""
        self.finish()
        return self.vector.clone(), self.version

    def message(self, rank: int, message: torch.Tensor) -> torch.Tensor:
        """Rank's pushed message as float32; ValueError when it is not this state's.

        A 16-bit message (--compress) carries the gradients in 16 bits and the buffers in
        float32, each float32 as two 16-bit values (app.worker.compress.Compressor)."""
        expected = wire_size(message.dtype, self.num_params, self.size)
        if message.numel() != expected or message.dtype not in WIRE_DTYPES:
            holds = f"values {self.part[0]}..{self.part[1]} of the model" if self.sliced else "the model"
            raise ValueError(
                f"worker{rank} pushed {message.numel()} {message.dtype} values; "
                f"{holds} has {self.size} float32 values ({expected} as sent compressed)"
            )
        return to_float32(message, self.num_params)

    def finite(self, message: torch.Tensor) -> bool:
        """No NaN or inf in `message`."""
        return all_finite(message)

    def scale_for(self, staleness: int, norm: float = -1.0) -> float:
        """What a push's gradient is multiplied by: Zhang et al. 2016, a push `staleness` updates
        late counts 1 / staleness as much (so momentum carries the scaled gradient too); and,
        with train.clip_grad_norm, the clipping of a gradient of global norm `norm`."""
        scale = 1.0 / max(1, staleness) if self.config.staleness_lr else 1.0
        return scale * self.clip_factor(norm)

    def clip_factor(self, norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s factor for a gradient of global norm `norm` (-1: not
        computed); 1.0 without clipping."""
        clip = self.config.clip_grad_norm
        return min(1.0, clip / (norm + CLIP_EPS)) if clip and norm >= 0 else 1.0

    def plan(self, epoch_batches: int) -> None:
        """The run's length, from the first push this process gets that says its epoch's batches
        (every push of the run says the same): the schedule spans it. A resumed run planned
        again with a longer (or shorter) run, train.epochs or train.max_steps changed, spans the
        new plan from the version it resumed at, instead of holding the end of the old one."""
        p = self.config.plan
        if self._planned or (epoch_batches <= 0 and not p.max_steps):  # a stream without a length: max_steps plans
            return
        self._planned = True
        total = planned_updates(p.strategy, p.epochs, epoch_batches, p.workers, p.max_steps, p.local_steps)
        if total == self.total:
            return
        if self.total is not None:
            log.info(
                "the run's plan is now %d updates (the checkpoint's: %d); the schedule spans it", total, self.total
            )
        self.total = total
        if self.user_schedule is not None:
            self.user_schedule.start(total, self.version)
        self._set_lr()

    @property
    def scheduled(self) -> bool:
        """Whether the rate changes with the version (a schedule other than a constant rate)."""
        schedule = self.config.schedule
        return schedule["name"] != "constant" or bool(schedule.get("warmup"))

    def _set_lr(self) -> None:
        """The rate of the next update: the optimizer's times the schedule's factor at this version."""
        if self.scheduled:
            self.lr = self.base_lr * lr_factor(self.config.schedule, self.version, self.total or 0, self.base_lr)
            if self.plateau is not None:
                self.lr *= self.plateau.factor
            if self.user_schedule is not None:
                self.lr *= self.user_schedule.factor
        if isinstance(self.optimizer, SGD):
            self.optimizer.lr = self.lr
        else:
            self.optimizer.set_lr(self.lr / self.base_lr)

    def observe(self, headline: float) -> bool:
        """An evaluation's headline, for a plateau schedule; whether the rate fell."""
        if self.plateau is None or not self.plateau.observe(headline):
            return False
        self._set_lr()
        return True

    @property
    def writes_into(self) -> bool:
        """Whether a step can write the new state into a reply buffer (SGD's), rather than step the
        state in place and have the reply copied."""
        return isinstance(self.optimizer, SGD)

    def plain_sgd(self) -> bool:
        """No momentum, no weight decay, no clipping: a step is elementwise state - lr * grads, so
        a sync round can build the new state push by push."""
        return isinstance(self.optimizer, SGD) and self.optimizer.plain and not self.config.clip_grad_norm

    def step(self, message: torch.Tensor, scale: float = 1.0, into: torch.Tensor | None = None) -> None:
        """One SGD step with `message`'s grads times `scale`; its buffers become the global ones.

        `into` (a reply buffer no reply in flight uses; it may be the state itself): the new
        state is written there and becomes the state (`adopt`), so that reply needs no copy of
        the state. The step is torch.optim.SGD's, value for value, and its momentum buffer stays
        the optimizer's."""
        self.finish()
        n = self.num_params
        grads = message[:n] if scale == 1.0 else message[:n] * scale
        if into is None or not isinstance(self.optimizer, SGD):
            self.optimizer.step(grads)
            self.vector[n:].copy_(message[n:])
            if into is not None and into is not self.vector:  # a torch optimizer steps in place
                into.copy_(self.vector)
            into = None
        else:
            torch.add(self.vector[:n], self.optimizer.direction(grads), alpha=-self.lr, out=into[:n])
            into[n:].copy_(message[n:])
        self.adopt(into)

    def streams(self, into: torch.Tensor | None) -> bool:
        """Whether a step into `into` may be streamed (`step_streamed`): SGD's, into a reply buffer."""
        return into is not None and isinstance(self.optimizer, SGD) and bool(self.parts)

    def step_streamed(self, message: torch.Tensor, scale: float, into: torch.Tensor, progress: Progress) -> int:
        """As `step` into `into` (where `streams` says so), written in the order a worker's
        forward reads it: the buffers and the first partition now, `progress` raised once each
        partition is written (app.exchange.progress), the other partitions by `finish`, which
        the server calls once the answer has gone (and anything here that reads the state calls
        first). The state is the new one (its version, `into`) from now on. Returns the word's
        count before the step (the reply's `streamed`)."""
        self.finish()
        n, base = self.num_params, progress.count
        into[n:].copy_(message[n:])
        assert isinstance(self.optimizer, SGD)
        rest = self.optimizer.step_in_parts(
            message[:n], scale, self.vector[:n], into[:n], self.lr, self.parts, progress.publish
        )
        next(rest, None)
        self._rest = rest
        self.adopt(into)
        return base

    @property
    def unfinished(self) -> bool:
        """A streamed step has partitions left to write (`finish`)."""
        return self._rest is not None

    def finish(self) -> None:
        """Write the partitions a streamed step has left, if any."""
        rest, self._rest = self._rest, None
        if rest is not None:
            for _ in rest:
                pass

    def adopt(self, into: torch.Tensor | None) -> None:
        """`into` (when given) holds the new state: it becomes the state (the optimizer's
        parameter moves to it; the model's views follow when the model is read). One update more."""
        if into is not None:
            self.vector = into
            self.param.data = into[: self.num_params]
        self.version += 1
        if self.user_schedule is not None:
            self.user_schedule.step()
        self._set_lr()
        self.last_applied = self.clock()

    def checkpoint(self) -> dict[str, Any]:
        """The model's values, the optimizer and the version, copied. A shard's holds its slice
        as `vector` (with `part`), and no `model`'s values."""
        self.finish()
        model = {} if self.sliced else {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        saved: dict[str, Any] = {
            "version": self.version,
            "model": model,
            "optimizer": cpu_copy(self.optimizer.state_dict()),
            "total": self.total,
        }
        if self.plateau is not None:
            saved["plateau"] = self.plateau.state_dict()
        if self.user_schedule is not None:
            saved["user_schedule"] = self.user_schedule.state_dict()
        if self.sliced:
            saved.update(vector=self.vector.clone(), part=list(self.part))
        return saved

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue from a checkpoint (written by `checkpoint`)."""
        self.finish()
        if self.sliced:
            if list(saved.get("part", [])) != list(self.part):
                raise ValueError(f"the checkpoint holds values {saved.get('part')}, this shard {list(self.part)}")
            self.vector.copy_(saved["vector"])
        else:
            self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.version = int(saved["version"])
        self.total = saved.get("total", self.total)
        if self.plateau is not None and "plateau" in saved:
            self.plateau.load_state_dict(saved["plateau"])
        if self.user_schedule is not None and self.total:
            self.user_schedule.start(self.total, self.version, saved.get("user_schedule"))
        self._set_lr()
