"""Delayed Nesterov momentum: the outer optimizer of diloco_async (Liu et al. 2024,
"Asynchronous Local-SGD Training for Language Modeling", arXiv:2401.09135).

A PS that applies each worker's change as it arrives with plain Nesterov momentum lets a stale
change push the momentum as hard as a fresh one; delayed Nesterov keeps the momentum still
between updates of it. Each change g (a pseudo-gradient) is applied at once as plain SGD, at
lr / period; every `period` arrivals (the job's workers) the momentum buffer takes their mean
and momentum's part of a Nesterov step is applied:

    on each arrival:          p -= lr / period * g;  sum += g
    every period arrivals:    m = momentum * m + sum / period;  p -= lr * momentum * m;  sum = 0

So when `period` changes computed from one state arrive in a row, the result is one step of
torch.optim.SGD(lr, momentum, nesterov=True) with their mean as the gradient: synchronous
DiLoCo's outer step; with period 1 it is that SGD step for every change. The buffer, the sum and
the count of arrivals are the optimizer's state: in its state_dict, so a checkpoint keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov momentum over `params`: lr, momentum in [0, 1), period >= 1 arrivals."""

    def __init__(self, params: Iterable[Any], lr: float = 0.7, momentum: float = 0.9, period: int = 1) -> None:
        if not lr > 0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid momentum value: {momentum}")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"invalid period: {period!r} (a whole number of arrivals >= 1)")
        super().__init__(params, {"lr": lr, "momentum": momentum, "period": period})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, period = group["lr"], group["momentum"], group["period"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["arrivals"] = torch.zeros((), dtype=torch.int64)
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                p.add_(p.grad, alpha=-lr / period)
                state["sum"].add_(p.grad)
                state["arrivals"] += 1
                if int(state["arrivals"]) % period == 0:
                    buffer = state["momentum_buffer"]
                    buffer.mul_(momentum).add_(state["sum"], alpha=1.0 / period)
                    p.add_(buffer, alpha=-lr * momentum)
                    state["sum"].zero_()
        return loss
