"""The optimizer a PS process steps its parameter values with, built from the run's recipe
(app/recipes.py): torch.optim's rule, on views of the one state vector.

- Plain SGD settings (sgd with lr, momentum and weight decay on every parameter: the default):
  app.ps.sgd.SGD, torch.optim.SGD's arithmetic without building a torch optimizer (that imports
  torch._dynamo, ~2 CPU-s a process), whose step can be written into a reply buffer and, with
  no momentum or decay, built partition by partition.
- Anything else: the torch.optim optimizer (or the user's `module:factory`) over one view per
  parameter of the vector, in its own shape, so each parameter is stepped as torch.optim steps
  it in a model; a PS shard's slice cuts at most two parameters, stepped as the flat pieces it
  holds (every optimizer here is elementwise but Adafactor, which a sharded PS refuses). Norms'
  weights and biases (ndim <= 1) are a group without weight decay where the recipe says so.
  Built as app.training.optimizers builds every optimizer (fused kernels where torch has them).
  Stepped in place: a reply is then a copy of the state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from app.ps.sgd import SGD
from app.recipes import Optimizer
from app.training import optimizers

PLAIN_SGD_KEYS = {"lr", "momentum", "weight_decay"}


class Piece(NamedTuple):
    """A parameter's values start..end of the vector (their place in the slice a PS process
    holds: `at`), its shape there, and whether it takes weight decay."""

    at: int
    size: int
    shape: tuple[int, ...]
    decays: bool


def pieces(model: nn.Module, part: tuple[int, int], norm_and_bias_decay: bool) -> list[Piece]:
    """The parameters of `model` within values part[0]..part[1] of its state vector, in order:
    each one in its shape, or the flat piece of it the slice holds."""
    start, end = part
    out, offset = [], 0
    for name, p in model.named_parameters():
        lo, hi = max(offset, start), min(offset + p.numel(), end)
        if lo < hi:
            whole = (lo, hi) == (offset, offset + p.numel())
            decays = norm_and_bias_decay or optimizers.takes_decay(name, p)
            out.append(Piece(lo - start, hi - lo, tuple(p.shape) if whole else (hi - lo,), decays))
        offset += p.numel()
    return out


def build(param: torch.Tensor, model: nn.Module, part: tuple[int, int], recipe: Optimizer) -> SGD | TorchOptimizer:
    """The optimizer of `param` (the parameter values part[0].. of `model`'s vector that a PS
    process holds); UsageError for one that cannot be built (a bad keyword value, the user's
    factory failing)."""
    kwargs = recipe.kwargs
    decay = kwargs.get("weight_decay", 0)
    if recipe.name == "sgd" and set(kwargs) <= PLAIN_SGD_KEYS and (recipe.norm_and_bias_decay or not decay):
        return SGD(param, lr=kwargs["lr"], momentum=kwargs.get("momentum", 0.0), weight_decay=decay)
    return TorchOptimizer(param, pieces(model, part, recipe.norm_and_bias_decay), recipe)


class TorchOptimizer:
    """A torch.optim optimizer over shaped views of `param`, with SGD's interface here: `step`
    with a gradient vector, the rate set per update, its state_dict."""

    plain = False  # a step is the optimizer's, never built partition by partition

    def __init__(self, param: torch.Tensor, parts: list[Piece], recipe: Optimizer) -> None:
        self.param, self.parts, self.recipe = param, parts, recipe
        self.views = [self._view(param.detach(), piece) for piece in parts]  # leaves sharing its storage
        self.optimizer = optimizers.make(recipe, optimizers.groups(self.views, [p.decays for p in parts]))
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]

    @staticmethod
    def _view(vector: torch.Tensor, piece: Piece) -> torch.Tensor:
        return vector[piece.at : piece.at + piece.size].view(piece.shape)

    def set_lr(self, factor: float) -> None:
        """Every group's rate is its base rate times `factor` (the schedule's, for this update)."""
        optimizers.set_rates(self.optimizer, self.base_lrs, factor)

    def step(self, grads: torch.Tensor) -> None:
        """One step of `param` in place with `grads` (its gradient values, as a vector)."""
        for view, piece in zip(self.views, self.parts):
            view.grad = self._view(grads, piece)
        self.optimizer.step()
        for view in self.views:
            view.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from a saved state: the saved groups must be this optimizer's."""
        groups = saved.get("param_groups", [])
        sizes = [len(g["params"]) for g in groups]
        if sizes != [len(g["params"]) for g in self.optimizer.param_groups]:
            raise ValueError(
                f"the saved optimizer has parameter groups of {sizes} tensors; this {self.recipe.name} has "
                f"{[len(g['params']) for g in self.optimizer.param_groups]}"
            )
        self.optimizer.load_state_dict(saved)

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from self.views
