"""A GPU worker takes the PS's reply back partition by partition, in the order its forward needs
them: the copies from the (pinned) reply buffer in shared memory to the device run on a side
stream, the float buffers first (every BatchNorm reads its running stats), then the partitions
in parameter order; a hook before each module's forward makes the compute stream wait for the
copies of the partitions its own parameters are in that no earlier module waited for, and no
more (one wait per partition a step). So the first layers compute
while the last ones are still being copied.

The reply buffer stays as the PS wrote it until this worker's next push (app.exchange.ps_end), and
the compute stream has waited for every copy by the end of the next forward, before that push.
"""

from __future__ import annotations

import torch
from torch import nn

from app.exchange.layout import owners
from app.training.flat import FlatModel


def waits(model: nn.Module, parts: list[tuple[int, int]]) -> dict[nn.Module, tuple[list[int], bool]]:
    """For each module with parameters or float buffers of its own: the partitions its
    parameters are in, and whether it reads float buffers (which are copied first)."""
    params = list(model.parameters())
    owner = dict(zip([id(p) for p in params], owners([p.numel() for p in params], parts)))
    out = {}
    for module in model.modules():
        needs = sorted({owner[id(p)] for p in module.parameters(recurse=False)})
        has_buffers = any(b.is_floating_point() for b in module.buffers(recurse=False))
        if needs or has_buffers:
            out[module] = (needs, has_buffers)
    return out


class OrderedPull:
    """Copies replies into `flat`'s own storage on the device, partition by partition."""

    def __init__(self, model: nn.Module, flat: FlatModel, parts: list[tuple[int, int]]) -> None:
        self.flat, self.parts = flat, parts
        self.stream = torch.cuda.Stream(flat.own.device)
        self.events: list[torch.cuda.Event] = []
        self.buffers_copied: torch.cuda.Event | None = None
        self.compute: torch.cuda.Stream | None = None  # the stream the forward runs on
        self.waited: set[int] = set()  # partitions (-1: the buffers) it waits for already
        self.handles = [
            module.register_forward_pre_hook(self._waiter(needs, has_buffers))
            for module, (needs, has_buffers) in waits(model, parts).items()
        ]

    def _waiter(self, needs: list[int], has_buffers: bool):
        def wait(_module: nn.Module, _inputs: object) -> None:
            if not self.events or self.compute is None:
                return
            if has_buffers and self.buffers_copied is not None and -1 not in self.waited:
                self.compute.wait_event(self.buffers_copied)
                self.waited.add(-1)
            for j in needs:
                if j not in self.waited:
                    self.compute.wait_event(self.events[j])
                    self.waited.add(j)

        return wait

    def load(self, vector: torch.Tensor) -> None:
        """Start copying `vector` (the reply, in pinned host memory) into the model's own
        storage; the forward waits for what each module needs."""
        own, n = self.flat.own, self.flat.num_params
        self.compute = torch.cuda.current_stream(own.device)
        ready = torch.cuda.Event()
        ready.record(self.compute)  # the last backward is done with `own`
        events = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            own[n:].copy_(vector[n:], non_blocking=True)
            self.buffers_copied = torch.cuda.Event()
            self.buffers_copied.record(self.stream)
            for start, end in self.parts:
                end = min(end, n)
                if end > start:
                    own[start:end].copy_(vector[start:end], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
                events.append(event)
        self.events, self.waited = events, set()
        if self.flat.vector is not own:
            self.flat.adopt(own)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
