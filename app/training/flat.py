"""A model's state as one contiguous vector: what crosses the wire, in one message.

Layout of every vector and message: [parameters | floating-point buffers].
Parameters (and their .grad) and buffers (BatchNorm running stats) become
views into two flat tensors, so sending or loading the state is one tensor and
at most one copy (none for `adopt`), never a list of tensors or a pickled
module. Integer buffers (BatchNorm's num_batches_tracked) stay local: they do
not affect the math when momentum is set, as it is in every torchvision model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn


def float_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, name, buffer) of each floating-point buffer, each tensor once: the buffer
    part of the state vector, in order."""
    found = []
    seen: set[int] = set()
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and id(buf) not in seen:
                seen.add(id(buf))
                found.append((module, name, buf))
    return found


def state_size(model: nn.Module) -> int:
    """Values in the model's state vector: parameters and float buffers."""
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for _, _, b in float_buffers(model))


class FlatModel:
    """Rebinds a model's parameters, grads and float buffers onto flat storage.

    `vector` holds [params | buffers]; `message` holds [grads | buffers] and is
    what a worker pushes (`grads` is its first part, where backward accumulates).
    Both own their whole storage, so RPC sends exactly these bytes. Every param's
    .grad is a view into `message` outside `writing_grads` (nothing else may set it
    to None or replace it); any backward outside `writing_grads` adds into it, after
    `zero_grads`. A backward under `writing_grads` leaves exactly its gradient there,
    one of two ways:

    - write-once (a message in host memory): a hook on each parameter's gradient
      copies it into its place and hands that view on, which autograd keeps as .grad:
      one write of the gradient's bytes, and a Python call per parameter;
    - in place (`accumulate`, by default a message on a GPU): each .grad stays its view
      of the message, as DDP's `gradient_as_bucket_view` makes it, the message's grads
      are zeroed (one fill on the device) and autograd adds each gradient into its view
      in C++: no Python per parameter, where on a GPU a Python call costs more than the
      fill and the add. On a CPU the fill and the add's read cost more than the hooks
      (45 MB for ResNet-18: ~2 ms more a step on a 2-core CPU VM), so there the hooks stay.

    `own_buffers` (a worker): the float buffers always live in the model's own storage,
    even when `adopt` makes the parameters views of a vector that is not the model's (a
    reply in memory the PS shares): the forward updates BatchNorm's running stats in
    place, and that vector must stay as the PS wrote it.
    """

    def __init__(
        self, model: nn.Module, with_grads: bool = True, own_buffers: bool = False, accumulate: bool | None = None
    ) -> None:
        params = [p for p in model.parameters()]
        buffers = float_buffers(model)
        self.num_params = sum(p.numel() for p in params)
        self.num_buffers = sum(b.numel() for _, _, b in buffers)
        device = params[0].device if params else torch.device("cpu")
        size = self.num_params + self.num_buffers
        self._params = params
        self._buffers = [(module, name, buf.shape) for module, name, buf in buffers]
        self.vector = torch.empty(size, device=device)
        self.own = self.vector  # the model's own storage (`load` writes here, never elsewhere)
        self.own_buffers = own_buffers
        self._buffers_in_own = False  # own_buffers: the buffers are views of `own` already
        self.message = torch.zeros(size if with_grads else 0, device=device)
        self._spare: torch.Tensor | None = None  # the other message buffer, once `flip` needs one
        # Views of tensors the model comes back to every step (`keep_views_of`): data_ptr -> views.
        self._kept: dict[int, list[torch.Tensor]] = {}
        # the write-once hooks' sum of each gradient they wrote (`finite_proof`), and the last
        # backward's: (the message it wrote, those sums)
        self._sums: list[torch.Tensor] = []
        self._proof: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        state = params + [buf for _, _, buf in buffers]
        for view, tensor in zip(self._views(self.vector, [t.shape for t in state]), state):
            view.copy_(tensor.detach())
        self._point_at(self.vector)
        self.accumulate = device.type != "cpu" if accumulate is None else accumulate
        if with_grads:
            self.keep_views_of([self.message])
            self._grads_into(self.message)
            offset = 0
            for p in params if not self.accumulate else []:
                p.register_hook(self._into_message(p, offset))
                offset += p.numel()

    def keep_views_of(self, tensors: list[torch.Tensor]) -> None:
        """Make the views of `tensors` once, for good: buffers the model is pointed at or writes
        its messages into every step (a worker's push slots and the PS's reply buffers in shared
        memory), which live as long as the process. Re-pointing the model at one of them then
        makes no new tensor."""
        shapes = self._shapes()
        for tensor in tensors:
            if tensor.numel() >= self.size:
                self._kept[tensor.data_ptr()] = self._views(tensor, shapes)

    def _shapes(self) -> list[torch.Size]:
        return [p.shape for p in self._params] + [shape for _, _, shape in self._buffers]

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The param and buffer views of `flat`: kept ones, or new."""
        kept = self._kept.get(flat.data_ptr())
        return kept if kept is not None else self._views(flat, self._shapes())

    @staticmethod
    def _views(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
        """Consecutive views of `flat`, one per shape."""
        views, offset = [], 0
        for shape in shapes:
            n = shape.numel()
            views.append(flat[offset : offset + n].view(shape))
            offset += n
        return views

    def _grads_into(self, message: torch.Tensor) -> None:
        """Make each param's .grad a view into the grads part of `message`."""
        for p, view in zip(self._params, self._views_of(message)):
            p.grad = view

    def _into_message(self, param: torch.Tensor, offset: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The hook on `param`'s gradient (values offset.. of the grads): under `writing_grads`
        (.grad None), the gradient is copied into its place in `message` and that view is
        handed on, which autograd then takes as .grad as it is (it adds nothing into it);
        otherwise the gradient goes on unchanged and autograd adds it into .grad."""
        shape = param.shape

        def into_message(grad: torch.Tensor) -> torch.Tensor:
            message = self.message
            if param.grad is not None or grad.layout != torch.strided or grad.dtype != message.dtype:
                return grad
            view = message[offset : offset + shape.numel()].view(shape)
            view.copy_(grad)
            self._sums.append(view.sum())  # while its values are in cache: the message's finite proof
            return view

        return into_message

    @contextlib.contextmanager
    def writing_grads(self) -> Iterator[None]:
        """A backward run inside leaves exactly its gradient in `message`, zeros for a parameter
        it does not reach; after it every .grad is its view into `message`. Write-once: each
        gradient copied into its view by its hook (no fill first). In place (`accumulate`): the
        grads zeroed now (queued on a GPU's stream) and autograd adds into the views, so the
        backward must not build a graph of its own (create_graph would replace .grad)."""
        if self.accumulate:
            self.grads.zero_()
            yield
            return
        for p in self._params:
            p.grad = None
        self._sums, self._proof = [], None
        written = False
        try:
            yield
            written = True
        finally:
            for p, view in zip(self._params, self._views_of(self.message)):
                grad = p.grad
                if grad is None:
                    view.zero_()
                elif grad.layout != torch.strided:  # a sparse gradient, handed on as it came
                    view.copy_(grad.to_dense())
                    self._sums.append(view.sum())
                elif grad.data_ptr() != view.data_ptr():  # autograd kept a copy of its own
                    view.copy_(grad)
                    self._sums.append(view.sum())
                p.grad = view
            if written:
                self._proof = (self.message, self._sums)
            self._sums = []

    def flip(self) -> None:
        """Swap `message` for a second buffer of its own and point the grads into it (the
        first call allocates it): the next backward fills that one, and the message just
        sent stays intact, without a copy, until the flip after next."""
        if self._spare is None:
            self._spare = torch.zeros_like(self.message)
            self.keep_views_of([self._spare])
        self.message, self._spare = self._spare, self.message
        self._grads_into(self.message)

    def use_messages(self, buffers: list[torch.Tensor]) -> None:
        """Write messages into `buffers` (one, or two that `flip` alternates) instead of the
        model's own: a worker's push slots in memory the PS shares, so backward writes the
        gradient straight where the PS reads it."""
        for buffer in buffers:
            if buffer.numel() < self.size or buffer.dtype != self.message.dtype or buffer.device != self.message.device:
                raise ValueError(f"a message buffer of {buffer.numel()} {buffer.dtype} values cannot hold this model's")
        self.message = buffers[0][: self.size]
        self._spare = buffers[1][: self.size] if len(buffers) > 1 else self.message
        self.message.zero_()
        self._grads_into(self.message)

    def _point_at(self, vector: torch.Tensor) -> None:
        """Make the params and float buffers views into `vector` (no copy); with own_buffers
        the buffers stay in the model's own storage (their values copied from `vector`)."""
        views = self._views_of(vector)
        for p, view in zip(self._params, views):
            p.data = view
        if self.own_buffers and vector is not self.own:
            self.own[self.num_params :].copy_(vector[self.num_params :])
        if not (self.own_buffers and self._buffers_in_own):  # once, with own_buffers: they stay put
            if self.own_buffers and vector is not self.own:
                views = self._views_of(self.own)
            for (module, name, _), view in zip(self._buffers, views[len(self._params) :]):
                module._buffers[name] = view
            self._buffers_in_own = self.own_buffers
        self.vector = vector

    @property
    def size(self) -> int:
        return self.num_params + self.num_buffers

    @property
    def params(self) -> torch.Tensor:
        """The parameter part of `vector` (a view)."""
        return self.vector[: self.num_params]

    @property
    def grads(self) -> torch.Tensor:
        """The gradient part of `message` (a view): each param's .grad lives here."""
        return self.message[: self.num_params]

    def zero_grads(self) -> None:
        self.grads.zero_()

    @property
    def buffers(self) -> torch.Tensor:
        """The float buffers' values as the model has them now (a view)."""
        return (self.own if self.own_buffers else self.vector)[self.num_params :]

    def pack_message(self) -> torch.Tensor:
        """Copy the current buffers behind the grads; return the whole message."""
        self.message[self.num_params :].copy_(self.buffers)
        return self.message

    def finite_proof(self) -> torch.Tensor | None:
        """After `pack_message`, once: whether the message holds no NaN or inf, as a one-value
        bool tensor (True proves it: a NaN or inf makes a sum NaN or inf; False may also be a
        sum of finite values that overflowed), from the sums the write-once hooks took of each
        gradient as they wrote it, while its values were in cache: no pass over the message
        after the backward. None where no such backward wrote this message last (in place, as
        on a GPU). A caller that changed the message since the backward (a local strategy's
        change) must not ask for it."""
        proof, self._proof = self._proof, None
        if proof is None or proof[0] is not self.message:
            return None
        buffers = self.message[self.num_params :]
        return torch.isfinite(torch.stack([*proof[1], buffers.sum()]).sum())

    def load(self, vector: torch.Tensor) -> None:
        """Overwrite params and buffers with a received vector (any device), in the model's
        own storage."""
        if vector.numel() != self.size:
            raise ValueError(f"state has {vector.numel()} values, this model needs {self.size}")
        self.own.copy_(vector, non_blocking=True)
        if self.vector is not self.own:
            self._point_at(self.own)

    def adopt(self, vector: torch.Tensor) -> None:
        """Make a received vector the model's state, without copying it when it can be
        (same device and dtype, contiguous): the caller gives it up, or (own_buffers) keeps
        it unchanged while the model uses it. Grads stay put."""
        if (
            vector.device != self.vector.device
            or vector.dtype != self.vector.dtype
            or not vector.is_contiguous()
            or vector.numel() != self.size
        ):
            self.load(vector)
        else:
            self._point_at(vector)
