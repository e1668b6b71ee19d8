"""torch.optim optimizers from a run's recipe (app/recipes.py): the one way both a PS process
(app/ps/optim.py, over views of its vector) and an allreduce rank (over its model's parameters)
build theirs, and the groups that leave norms and biases out of weight decay.

Fused kernels where torch has them for the device (adam, adamw, sgd, adagrad), else foreach,
unless the recipe says which. The user's `package.module:factory` is called as
`factory(param_groups, **kwargs)` and must return a torch.optim.Optimizer.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from app import plugins
from app.config import UsageError
from app.recipes import DELAYED_NESTEROV, OPTIMIZERS, Optimizer
from app.training.delayed_nesterov import DelayedNesterov


def takes_decay(name: str, param: torch.Tensor) -> bool:
    """Whether a parameter is one weight decay applies to when norms and biases are left out
    (timm's rule: not one value per channel, not a bias)."""
    return not (param.ndim <= 1 or name.endswith(".bias"))


def groups(params: list[torch.Tensor], decays: list[bool]) -> list[dict[str, Any]]:
    """The parameter groups: those that decay (the optimizer's weight decay), and the others
    with none; an empty group is left out."""
    made: list[dict[str, Any]] = [
        {"params": [p for p, d in zip(params, decays) if d]},
        {"params": [p for p, d in zip(params, decays) if not d], "weight_decay": 0.0},
    ]
    return [g for g in made if g["params"]]


def model_groups(model: nn.Module, recipe: Optimizer) -> list[dict[str, Any]]:
    """The groups of a model's own parameters under `recipe`."""
    named = list(model.named_parameters())
    decays = [recipe.norm_and_bias_decay or takes_decay(n, p) for n, p in named]
    return groups([p for _, p in named], decays)


def make(recipe: Optimizer, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The optimizer `recipe` names over `param_groups`; UsageError when it cannot be built (a
    keyword value torch refuses, the user's factory failing or returning something else)."""
    name = recipe.name
    kwargs = dict(recipe.kwargs)
    where = f"--optimizer {name}"
    if plugins.is_entry_point(name):
        made = plugins.call(where, plugins.resolve("optimizer", name), param_groups, **kwargs)
        if not isinstance(made, torch.optim.Optimizer):
            raise UsageError(f"{where}: returned a {type(made).__name__}; must return a torch.optim.Optimizer")
        if needs_closure(made):
            raise UsageError(
                f"{where}: returned a {type(made).__name__}, whose step needs a closure (it evaluates the loss "
                "again); the PS steps with each push's gradient alone: use an optimizer that steps without one"
            )
        return made
    if name == DELAYED_NESTEROV:  # diloco_async's outer optimizer (app/recipes.py outer_optimizer)
        return DelayedNesterov(param_groups, **kwargs)
    cls = getattr(torch.optim, OPTIMIZERS[name][0])
    if "fused" not in kwargs and "foreach" not in kwargs:
        kwargs["fused" if "fused" in inspect.signature(cls).parameters else "foreach"] = True
    try:
        return cls(param_groups, **kwargs)
    except (TypeError, ValueError, RuntimeError) as error:
        raise UsageError(f"{where}: {plugins.one_line(error)}") from None


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` cannot be called without a closure (LBFGS: it evaluates the loss again)."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    return isinstance(optimizer, torch.optim.LBFGS) or (
        closure is not None and closure.default is inspect.Parameter.empty
    )


def set_rates(optimizer: torch.optim.Optimizer, base_lrs: list[float], factor: float) -> None:
    """Every group's rate is its base rate times `factor` (the schedule's, for the next step)."""
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = base * factor
