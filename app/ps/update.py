"""The arithmetic of a push on the PS, on flat tensors: a sync round's mean and SGD's direction
(the wire format and the NaN/inf check: app.exchange.wire).

Pure functions (no lock, no roster): app.ps.server applies them under its lock.
"""

from __future__ import annotations

import torch


def mean_into(messages: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The mean of two or more messages, summed in the order given into `out` (the
    messages stay untouched); `out`."""
    torch.add(messages[0], messages[1], out=out)
    for message in messages[2:]:
        out.add_(message)
    return out.div_(len(messages))


def sgd_direction(optimizer: torch.optim.SGD, param: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """What SGD subtracts `lr` times from `param`: the gradient (plus weight_decay times
    the parameters), or with momentum the optimizer's momentum buffer updated with it
    (torch.optim.SGD's rule, no dampening or nesterov); the buffer stays in the
    optimizer's state, so checkpoints carry it."""
    group = optimizer.param_groups[0]
    if group["weight_decay"]:
        grads = grads.add(param.detach(), alpha=group["weight_decay"])
    momentum = group["momentum"]
    if not momentum:
        return grads
    state = optimizer.state[param]
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = grads.detach().clone()
    else:
        buf.mul_(momentum).add_(grads)
    return buf
