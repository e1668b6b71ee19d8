"""A worker's local steps (train.strategy diloco and diloco_async): its own (inner) optimizer,
stepped with each batch's gradient, and the state it last pulled from the PS.

Every train.local_steps batches the worker pushes the change of its parameters since that pull,
`anchor - parameters` (DiLoCo's pseudo-gradient, in the place of a gradient: the PS steps its
outer optimizer with it), and continues from the state the PS answers. The inner optimizer is
the run's train.optimizer with train.lr, built as torch.optim builds it over the model's own
parameters; its state lives in this process and carries over from one push to the next, as
DiLoCo's inner AdamW does. A worker that joins (or rejoins after a restart) starts a fresh one
from the global state: its state is not in the PS's checkpoints. train.schedule sets its rate by
the rank's own steps (a linear warmup, then cosine, step or linear over the steps planned);
train.clip_grad_norm clips each batch's gradient before its step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from app.config import Config
from app.recipes import lr_factor, resolve_optimizer
from app.training import optimizers
from app.training.flat import FlatModel


class LocalSteps:
    """The inner optimizer of one worker and the state its next change is measured from."""

    def __init__(self, config: Config, model: nn.Module, flat: FlatModel) -> None:
        self.model, self.flat = model, flat
        self.every = config.local_steps
        self.clip = config.clip_grad_norm
        self.schedule = config.schedule
        self.recipe = resolve_optimizer(config.optimizer, config.lr, config.momentum, config.weight_decay)
        self.base_lr = float(self.recipe.kwargs["lr"])
        self.optimizer: torch.optim.Optimizer | None = None
        self.base_lrs: list[float] = []
        self.anchor: torch.Tensor | None = None  # the parameters as last pulled
        self.taken = 0  # batches since the last push
        self.samples = 0  # their samples
        self.steps = 0  # the rank's steps in all: the schedule's clock
        self.total = 0  # the steps the schedule spans (0: not known)

    def restart(self, steps: int, total: int) -> None:
        """At a join: a fresh inner optimizer over the model's parameters, the rank `steps` steps
        into a run of `total` steps (the schedule's span; 0: not known, the rate unscheduled),
        measured from the state the model holds."""
        self.optimizer = optimizers.make(self.recipe, optimizers.model_groups(self.model, self.recipe))
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.steps, self.total = steps, total
        self.pulled()

    def pulled(self) -> None:
        """The model holds the PS's state now: into the model's own storage (an answer in memory
        the PS shares must stay as the PS wrote it: the inner steps write the parameters), and
        the next change is measured from it."""
        flat = self.flat
        if flat.vector is not flat.own:
            flat.load(flat.vector)
        if self.anchor is None:
            self.anchor = flat.params.clone()
        else:
            self.anchor.copy_(flat.params)
        self.taken = self.samples = 0

    def refused(self) -> None:
        """The PS refused the change (non-finite values): back to the state last pulled."""
        assert self.anchor is not None
        self.flat.params.copy_(self.anchor)
        self.taken = self.samples = 0

    def step(self, samples: int) -> bool:
        """One step of the inner optimizer with the gradient of a batch of `samples` (each
        .grad); whether the change is due at the PS."""
        assert self.optimizer is not None  # restarted at the join
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if self.total and (self.schedule["name"] != "constant" or self.schedule.get("warmup")):
            factor = lr_factor(self.schedule, self.steps, self.total, self.base_lr)
            optimizers.set_rates(self.optimizer, self.base_lrs, factor)
        self.optimizer.step()
        self.steps += 1
        self.taken += 1
        self.samples += samples
        return self.taken >= self.every

    @property
    def pending(self) -> bool:
        """Steps taken since the last push (the last ones of a share or of the run, pushed too)."""
        return self.taken > 0

    def change(self) -> None:
        """The pseudo-gradient, `anchor - parameters`, where the gradient was: the message's grads."""
        assert self.anchor is not None
        torch.sub(self.anchor, self.flat.params, out=self.flat.grads)

    def pushes_for(self, batches: int) -> int:
        """The pushes `batches` more batches make (a change every `every` of them)."""
        return math.ceil(max(0, batches) / self.every)
