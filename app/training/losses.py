"""The loss a run trains with (train.loss, app/recipes.py): torch.nn's by name, or the user's own.

A built-in loss takes a sequence model's outputs [batch, length, classes] against targets
[batch, length] position by position (as a language model's cross-entropy is taken), and a
classifier's [batch, classes] against [batch] as torch.nn does. The user's
`package.module:factory` is called with the spec's keyword arguments and must return a
callable `loss(outputs, targets) -> a scalar tensor`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from app import plugins
from app.config import UsageError
from app.recipes import LOSSES, Spec

# The losses whose targets are class indices: outputs carry one more dimension (the classes).
CLASS_TARGETS = ("cross_entropy", "nll")


class PerPosition(nn.Module):
    """A class-index loss taken position by position when the outputs have a class dimension
    after a sequence's (outputs [B, T, C], targets [B, T]); as it is otherwise."""

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if outputs.dim() == targets.dim() + 1 and outputs.dim() > 2 and outputs.shape[:-1] == targets.shape:
            return self.loss(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
        return self.loss(outputs, targets)


def build(spec: Spec) -> Callable[[Any, Any], torch.Tensor]:
    """The loss `spec` names; UsageError when it cannot be built."""
    name = spec["name"]
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    where = f"--loss {name}"
    if plugins.is_entry_point(name):
        made = plugins.call(where, plugins.resolve("loss", name), **kwargs)
        if not callable(made):
            raise UsageError(
                f"{where}: returned a {type(made).__name__}; must return a callable loss(outputs, targets)"
            )
        return made
    try:
        loss = getattr(nn, LOSSES[name][0])(**kwargs)
    except (TypeError, ValueError) as error:
        raise UsageError(f"{where}: {plugins.one_line(error)}") from None
    return PerPosition(loss) if name in CLASS_TARGETS else loss
