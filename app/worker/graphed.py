"""train.cuda_graphs: a GPU worker's forward and backward captured once as a CUDA graph, and
replayed every step.

PyTorch's whole-network capture (torch.cuda.graphs): static input and target tensors, a few
warm-up steps on a side stream (cuDNN's choices and the allocator settle there), then one capture
under `torch.cuda.graph`, whose gradients live in the graph's private memory pool. Each step
copies its batch into the static inputs, replays, and copies the static gradients into the flat
message the worker pushes (app.training.flat.FlatModel). A batch of another shape than the
captured one (the last, partial batch of an epoch) runs eagerly, as without graphs.

No Python runs inside a replay, so the worker's route is bound without the hooks a step would
run: no copies of partitions during the backward (the push is copied whole after the step) and no ordered pull
(the reply is copied whole onto the compute stream before the replay). The warm-up's forwards
update BatchNorm's running stats: they are put back as they were, so the first replayed step
computes on the state the PS sent. A model that cannot be captured (control flow that depends
on the data, a host sync in its forward or its loss) is a UsageError: one line, exit 2.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from app.config import Config, UsageError
from app.runtime import devices
from app.training.flat import FlatModel

log = logging.getLogger("app.worker")
WARMUP = 3  # steps on a side stream before the capture (PyTorch's example takes 3)
Shape = tuple[torch.Size, tuple[int, ...], torch.dtype, torch.Size, torch.dtype]


def for_worker(
    config: Config, model: nn.Module, flat: FlatModel, loss_fn: Callable, device: torch.device
) -> GraphedStep | None:
    """The graphed step where --cuda_graphs asks for it and the device is a GPU; None (eager)
    otherwise, with one line on a CPU worker."""
    if not config.cuda_graphs:
        return None
    if device.type != "cuda":
        log.info("%s: --cuda_graphs needs device cuda; the step runs eagerly on %s", config.name, device)
        return None
    return GraphedStep(model, flat, loss_fn, config.precision, device, config.model, config.batch_size)


def shape_of(x: torch.Tensor, y: torch.Tensor) -> Shape:
    return x.shape, x.stride(), x.dtype, y.shape, y.dtype


class GraphedStep:
    """One step's forward and backward as a CUDA graph, captured on the first full batch."""

    def __init__(
        self,
        model: nn.Module,
        flat: FlatModel,
        loss_fn: Callable,
        precision: str,
        device: torch.device,
        name: str,
        batch_size: int,
    ) -> None:
        self.model, self.flat, self.loss_fn = model, flat, loss_fn
        self.precision, self.device, self.name, self.batch_size = precision, device, name, batch_size
        self.params = list(model.parameters())
        self.graph: torch.cuda.CUDAGraph | None = None
        self.shape: Shape | None = None
        self.static_x = self.static_y = self.static_loss = torch.empty(0)
        self.static_grads: list[torch.Tensor] = []  # in the graph's pool, one per parameter it reaches
        self.reached_views: list[torch.Tensor] = []  # their .grad: views of the flat message
        self.unreached_views: list[torch.Tensor] = []  # the others' (zeroed each step)
        self.at = (0, 0)  # where the parameters and the message were when captured (they stay there)
        self.replays = 0

    def fits(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether this batch replays the graph (or captures it: a full batch comes first)."""
        if self.graph is None:
            return len(x) == self.batch_size
        return shape_of(x, y) == self.shape

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This batch's gradient into the flat message's grads; the loss, on the device."""
        if self.graph is None:
            self.capture(x, y)
        assert self.graph is not None
        if (self.flat.vector.data_ptr(), self.flat.message.data_ptr()) != self.at:
            raise RuntimeError("the model's parameters or its message moved after the CUDA graph was captured")
        self.static_x.copy_(x)
        self.static_y.copy_(y)
        self.graph.replay()
        torch._foreach_copy_(self.reached_views, self.static_grads)
        if self.unreached_views:  # parameters the graph computes no gradient for
            torch._foreach_zero_(self.unreached_views)
        self.replays += 1
        return self.static_loss

    def capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Warm up on a side stream, then capture; the model's buffers and its .grad views are
        as they were before. A failed capture: UsageError naming the model and the error."""
        self.static_x, self.static_y = torch.empty_like(x), torch.empty_like(y)
        self.static_x.copy_(x)
        self.static_y.copy_(y)
        views = [p.grad for p in self.params]  # each a view of the flat message (FlatModel)
        saved = [b.detach().clone() for b in self.model.buffers()]
        try:
            self._warm_up()  # eager steps: an error there is the model's own, not the capture's
            graph = torch.cuda.CUDAGraph()
            self._clear_grads()
            try:
                with torch.cuda.graph(graph):
                    self.static_loss = self._forward_backward(cache=False)
            except Exception as error:  # noqa: BLE001 - what torch raises for a capture varies
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise UsageError(
                    f"--cuda_graphs: model {self.name} cannot be captured as a CUDA graph: {first}"
                ) from None
        finally:
            for b, value in zip(self.model.buffers(), saved):
                b.copy_(value)
        self.static_grads, self.reached_views, self.unreached_views = [], [], []
        for p, view in zip(self.params, views):
            assert view is not None  # FlatModel keeps every .grad a view of its message
            if p.grad is not None:
                self.static_grads.append(p.grad)
                self.reached_views.append(view)
            else:
                self.unreached_views.append(view)
            p.grad = view
        self.graph, self.shape = graph, shape_of(x, y)
        self.at = (self.flat.vector.data_ptr(), self.flat.message.data_ptr())
        log.info("%s: the step captured as a CUDA graph (batch %s)", self.name, tuple(x.shape))

    def _warm_up(self) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self._clear_grads()
                self._forward_backward(cache=True)
        torch.cuda.current_stream(self.device).wait_stream(side)

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _forward_backward(self, cache: bool) -> torch.Tensor:
        with devices.autocast(self.precision, self.device, cache=cache):
            loss = self.loss_fn(self.model(self.static_x), self.static_y)
        loss.backward()
        return loss.detach()
