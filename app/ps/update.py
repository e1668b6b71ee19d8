"""The arithmetic of a push on the PS, on flat tensors: the wire format back to
float32, the NaN/inf check, a sync round's mean, and SGD's direction.

Pure functions (no lock, no roster): app.ps.server applies them under its lock.
"""

from __future__ import annotations

import torch

WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def wire_size(message_dtype: torch.dtype, num_params: int, size: int) -> int:
    """How many values a push of a `size`-value state with `num_params` parameters has:
    `size` in float32; in 16 bits the gradients take one value each and the float32
    buffers two (app.worker.compress.Compressor)."""
    return size if message_dtype == torch.float32 else num_params + 2 * (size - num_params)


def to_float32(message: torch.Tensor, num_params: int) -> torch.Tensor:
    """A pushed message as float32: as it is, or a 16-bit one's gradients widened and its
    buffers' bits read back as float32."""
    if message.dtype == torch.float32:
        return message
    return torch.cat([message[:num_params].float(), message[num_params:].clone().view(torch.float32)])


def all_finite(message: torch.Tensor) -> bool:
    """No NaN or inf in `message`. A finite sum decides it in one pass (a NaN or inf in the
    message makes the sum NaN or inf); only when the sum is not finite is each value checked,
    as a sum of finite values can overflow."""
    return bool(torch.isfinite(message.sum())) or bool(torch.isfinite(message).all())


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
