"""What a PS process serves: the state vector [params | buffers] (the whole model's, or a PS
shard's slice of it), its SGD optimizer (app.ps.sgd) and its version; the step a push makes, value
for value torch.optim.SGD's; a copy, a checkpoint and a restore of itself.

A push is `[grads | buffers]` as one flat tensor: SGD steps the parameters, and the buffers
(BatchNorm running stats) replace the global ones. Every worker starts each forward from the
buffers it received, so the running stats form one moving average over all workers' batches,
delayed like the parameters.

No lock of its own: app.ps.server calls it under its lock, and the strategy's policy
(app.ps.policies) steps it there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from app.checkpoint.files import cpu_copy
from app.exchange.wire import WIRE_DTYPES, all_finite, to_float32, wire_size
from app.ps.sgd import SGD
from app.training.flat import FlatModel


@dataclass(frozen=True)
class StateConfig:
    """The optimizer's settings and which values this PS process serves."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    staleness_lr: bool = False  # a push `staleness` updates late counts 1 / staleness as much
    part: tuple[int, int] | None = None  # a PS shard (app.ps.sharding.slices): values start..end


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
        self.lr = config.lr
        self.param = nn.Parameter(self.vector[: self.num_params])  # shares storage with the model
        self.optimizer = SGD(self.param, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
        self.version = 0
        self.last_applied: float | None = None  # clock time of the last update applied

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
        if not self.sliced and self._flat.vector is not self.vector:
            self._flat.adopt(self.vector)

    def copy(self) -> tuple[torch.Tensor, int]:
        """A copy of the state vector, and its version."""
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

    def finite(self, message: torch.Tensor, partitions: Sequence[tuple[int, int]], checked: set[int]) -> bool:
        """No NaN or inf in `message`; partitions `checked` (of `partitions`) are not read again:
        their worker checked each where it wrote it before it noted it (app.exchange.early_push)."""
        if not checked:
            return all_finite(message)
        n = self.num_params
        rest = [(s, min(e, n)) for j, (s, e) in enumerate(partitions) if j not in checked] + [(n, self.size)]
        return all(all_finite(message[s:e]) for s, e in rest if e > s)

    def scale_for(self, staleness: int) -> float:
        """Zhang et al. 2016: a push `staleness` updates late counts 1 / staleness as much
        (its gradient is scaled, so momentum carries the scaled gradient too)."""
        return 1.0 / max(1, staleness) if self.config.staleness_lr else 1.0

    def plain_sgd(self) -> bool:
        """No momentum and no weight decay: a step is elementwise state - lr * grads, so it can
        be built partition by partition."""
        return self.optimizer.plain

    def step(self, message: torch.Tensor, scale: float = 1.0, into: torch.Tensor | None = None) -> None:
        """One SGD step with `message`'s grads times `scale`; its buffers become the global ones.

        `into` (a reply buffer no reply in flight uses; it may be the state itself): the new
        state is written there and becomes the state (`adopt`), so that reply needs no copy of
        the state. The step is torch.optim.SGD's, value for value, and its momentum buffer stays
        the optimizer's."""
        n = self.num_params
        grads = message[:n] if scale == 1.0 else message[:n] * scale
        if into is None:
            self.optimizer.step(grads)
            self.vector[n:].copy_(message[n:])
        else:
            torch.add(self.vector[:n], self.optimizer.direction(grads), alpha=-self.lr, out=into[:n])
            into[n:].copy_(message[n:])
        self.adopt(into)

    def step_values(self, grads: torch.Tensor, scale: float, into: torch.Tensor, start: int, end: int) -> None:
        """Plain SGD on values start..end of the state (`grads` are those values'): the new values
        into `into`, the state unchanged."""
        if scale != 1.0:
            grads = grads * scale
        torch.add(self.vector[start:end], grads, alpha=-self.lr, out=into[start:end])

    def adopt(self, into: torch.Tensor | None) -> None:
        """`into` (when given) holds the new state: it becomes the state (the optimizer's
        parameter moves to it; the model's views follow when the model is read). One update more."""
        if into is not None:
            self.vector = into
            self.param.data = into[: self.num_params]
        self.version += 1
        self.last_applied = self.clock()

    def checkpoint(self) -> dict[str, Any]:
        """The model's values, the optimizer and the version, copied. A shard's holds its slice
        as `vector` (with `part`), and no `model`'s values."""
        model = {} if self.sliced else {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        saved: dict[str, Any] = {
            "version": self.version,
            "model": model,
            "optimizer": cpu_copy(self.optimizer.state_dict()),
        }
        if self.sliced:
            saved.update(vector=self.vector.clone(), part=list(self.part))
        return saved

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue from a checkpoint (written by `checkpoint`)."""
        if self.sliced:
            if list(saved.get("part", [])) != list(self.part):
                raise ValueError(f"the checkpoint holds values {saved.get('part')}, this shard {list(self.part)}")
            self.vector.copy_(saved["vector"])
        else:
            self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.version = int(saved["version"])
