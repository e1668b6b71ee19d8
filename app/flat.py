"""A model's state as one contiguous vector: what crosses the wire, in one message.

Layout of every vector and message: [parameters | floating-point buffers].
Parameters (and their .grad) and buffers (BatchNorm running stats) become
views into two flat tensors, so sending or loading the state is one tensor and
one copy, never a list of tensors or a pickled module. Integer buffers
(BatchNorm's num_batches_tracked) stay local: they do not affect the math
when momentum is set, as it is in every torchvision model.
"""

from __future__ import annotations

import torch
from torch import nn


def _float_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    found = []
    seen: set[int] = set()
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and id(buf) not in seen:
                seen.add(id(buf))
                found.append((module, name, buf))
    return found


class FlatModel:
    """Rebinds a model's parameters, grads and float buffers onto flat storage.

    `vector` holds [params | buffers]; `message` holds [grads | buffers] and is
    what a worker pushes (`grads` is its first part, where backward accumulates).
    Both own their whole storage, so RPC sends exactly these bytes.
    """

    def __init__(self, model: nn.Module, with_grads: bool = True) -> None:
        params = [p for p in model.parameters()]
        buffers = _float_buffers(model)
        self.num_params = sum(p.numel() for p in params)
        self.num_buffers = sum(b.numel() for _, _, b in buffers)
        device = params[0].device if params else torch.device("cpu")
        size = self.num_params + self.num_buffers
        self.vector = torch.empty(size, device=device)
        self.message = torch.zeros(size if with_grads else 0, device=device)
        offset = 0
        for p in params:
            view = self.vector[offset:offset + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
            if with_grads:
                p.grad = self.message[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        for module, name, buf in buffers:
            view = self.vector[offset:offset + buf.numel()].view_as(buf)
            view.copy_(buf)
            module._buffers[name] = view
            offset += buf.numel()

    @property
    def size(self) -> int:
        return self.num_params + self.num_buffers

    @property
    def params(self) -> torch.Tensor:
        """The parameter part of `vector` (a view)."""
        return self.vector[:self.num_params]

    @property
    def grads(self) -> torch.Tensor:
        """The gradient part of `message` (a view): each param's .grad lives here."""
        return self.message[:self.num_params]

    def zero_grads(self) -> None:
        self.grads.zero_()

    def pack_message(self) -> torch.Tensor:
        """Copy the current buffers behind the grads; return the whole message."""
        self.message[self.num_params:].copy_(self.vector[self.num_params:])
        return self.message

    def load(self, vector: torch.Tensor) -> None:
        """Overwrite params and buffers with a received vector (any device)."""
        if vector.numel() != self.size:
            raise ValueError(f"state has {vector.numel()} values, this model needs {self.size}")
        self.vector.copy_(vector, non_blocking=True)
