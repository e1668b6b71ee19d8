"""SGD on the PS's one parameter vector: torch.optim.SGD's rule for one CPU tensor (momentum
without dampening or nesterov, weight decay), value for value, and its `state_dict` format, so a
checkpoint written by either restores into the other.

Not torch.optim.SGD itself: building any torch.optim optimizer imports torch._dynamo (its
parameter groups are added under `torch._disable_dynamo`), about 2 CPU-seconds at every start of
a PS process, as much as the rest of its imports after torch's. On a CPU tensor torch.optim.SGD
takes its single-tensor path, which is the arithmetic below, operation for operation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# torch.optim.SGD's parameter group, as its state_dict writes it (the settings this SGD has not
# are their defaults there).
FIXED = {"dampening": 0, "nesterov": False, "maximize": False, "foreach": None, "differentiable": False, "fused": None}


class SGD:
    """Steps `param` with gradients: `param -= lr * direction(grads)`."""

    def __init__(self, param: torch.Tensor, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.param = param
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.momentum_buffer: torch.Tensor | None = None  # after the first step with momentum

    @property
    def plain(self) -> bool:
        """No momentum and no weight decay: a step is elementwise param - lr * grads."""
        return not (self.momentum or self.weight_decay)

    def direction(self, grads: torch.Tensor) -> torch.Tensor:
        """What a step subtracts `lr` times from `param`: the gradients (plus weight_decay times
        the parameters), or with momentum the momentum buffer updated with them."""
        if self.weight_decay:
            grads = grads.add(self.param.detach(), alpha=self.weight_decay)
        if not self.momentum:
            return grads
        if self.momentum_buffer is None:
            self.momentum_buffer = grads.detach().clone()
        else:
            self.momentum_buffer.mul_(self.momentum).add_(grads)
        return self.momentum_buffer

    def step_in_parts(
        self,
        grads: torch.Tensor,
        scale: float,
        old: torch.Tensor,
        into: torch.Tensor,
        lr: float,
        parts: Sequence[tuple[int, int]],
        publish: Callable[[], None],
    ) -> Iterator[None]:
        """`into = old - lr * direction(grads * scale)` (`old` the parameters before the step),
        written one partition of `parts` at a time, in order: `publish()` once each is written,
        then a yield. The same arithmetic as `direction`, value for value, partition by partition
        (every operation is elementwise); the momentum buffer is this optimizer's."""
        n = old.numel()
        fresh = bool(self.momentum) and self.momentum_buffer is None  # the first step: the buffer is the gradient
        if fresh:
            self.momentum_buffer = torch.empty_like(old)
        for start, end in parts:
            end = min(end, n)
            if end > start:
                part = grads[start:end] if scale == 1.0 else grads[start:end] * scale
                if self.weight_decay:
                    part = part.add(old[start:end], alpha=self.weight_decay)
                if self.momentum:
                    assert self.momentum_buffer is not None
                    buffer = self.momentum_buffer[start:end]
                    part = buffer.copy_(part) if fresh else buffer.mul_(self.momentum).add_(part)
                torch.add(old[start:end], part, alpha=-lr, out=into[start:end])
            publish()
            yield

    def step(self, grads: torch.Tensor) -> None:
        """One step of `param`, in place."""
        with torch.no_grad():
            self.param.add_(self.direction(grads), alpha=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.SGD's state_dict for this one parameter (not copied)."""
        state = {} if self.momentum_buffer is None else {0: {"momentum_buffer": self.momentum_buffer}}
        group = {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay, **FIXED, "params": [0]}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from a state_dict (this class's or torch.optim.SGD's of one parameter): as
        torch's optimizers do, its settings replace this SGD's."""
        groups = saved["param_groups"]
        if len(groups) != 1 or groups[0].get("params") != [0]:
            raise ValueError(f"the saved optimizer has {len(groups)} parameter group(s); this SGD steps one parameter")
        group = groups[0]
        unlike = {k: group[k] for k in ("dampening", "nesterov", "maximize") if group.get(k, FIXED[k]) != FIXED[k]}
        if unlike:
            raise ValueError(f"the saved optimizer has {unlike}; this SGD has { ({k: FIXED[k] for k in unlike}) }")
        self.lr, self.momentum, self.weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        buffer = saved["state"].get(0, {}).get("momentum_buffer")
        self.momentum_buffer = None if buffer is None else buffer.to(device=self.param.device, dtype=self.param.dtype)
