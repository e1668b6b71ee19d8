"""A GPU worker takes the PS's reply back partition by partition, in the order its forward needs
them: the copies from the (pinned) reply buffer in shared memory to the device run on a side
stream, the float buffers first (every BatchNorm reads its running stats), then the partitions
in parameter order; before the forward reaches a module, the compute stream waits for the copies
of the partitions its parameters are in that no earlier module waited for, and no more (one wait
per partition a step). So the first layers compute while the last ones are still being copied.

The first forward of the process looks: a hook before every module with parameters or float
buffers of its own records the order the modules run in. From then on one hook per partition
waits, on the module that needs that partition first (`plan`): one Python call per partition a
step, not one per module. (A module the first forward did not run keeps a hook of its own.)

The reply buffer stays as the PS wrote it until this worker's next push (app.exchange.ps_end), and
the compute stream has waited for every copy by the end of the next forward, before that push.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from app.exchange.layout import owners
from app.training.flat import FlatModel

BUFFERS = -1  # what `plan` calls the float buffers' copy (made before any partition's)


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


def plan(needs: dict[nn.Module, tuple[list[int], bool]], ran: list[nn.Module]) -> list[tuple[nn.Module, list[int]]]:
    """Where the forward waits: (module, the copies it waits for) for each module that is the first,
    in the order `ran` (the first forward's), to need a partition or the buffers (BUFFERS); then
    each module of `needs` that did not run, for all it needs."""
    waited: set[int] = set()
    out = []
    for module in dict.fromkeys(ran):
        parts, has_buffers = needs[module]
        new = ([BUFFERS] if has_buffers else []) + parts
        new = [j for j in new if j not in waited]
        if new:
            out.append((module, new))
            waited.update(new)
    seen = set(dict.fromkeys(ran))
    out += [(m, ([BUFFERS] if b else []) + p) for m, (p, b) in needs.items() if m not in seen]
    return out


class ForwardWaits:
    """Hooks before the modules of a forward that wait for what each needs of a reply: the
    partitions its parameters are in, and the float buffers (BUFFERS). The first forward records
    the order the modules run in (a hook on every module of `needs`, each waiting for all its
    module needs); once it has, `arm` puts one hook per partition where the forward first needs
    it, and `disarm` takes them off. What a wait is (a CUDA event, a futex word) is the
    subclass's `_wait_for`."""

    def __init__(self, model: nn.Module, parts: list[tuple[int, int]]) -> None:
        self.needs = waits(model, parts)
        self.ran: list[nn.Module] = []  # the first forward: modules in the order they ran
        self.handles = [module.register_forward_pre_hook(self._ran) for module in self.needs]
        self.planned: list[tuple[nn.Module, list[int]]] | None = None  # where the forward waits, once known

    def _wait_for(self, copies: list[int]) -> None:
        raise NotImplementedError

    def arm(self) -> None:
        """The per-partition hooks in place, once the first forward has run (before it, the
        recording hooks stay, and wait for all their module needs)."""
        if self._plan() and not self.handles:
            self.handles = [m.register_forward_pre_hook(self._waiter(copies)) for m, copies in self.planned or []]

    def disarm(self) -> None:
        """No hook runs in the forward, once the first forward has run (before it, the recording
        hooks stay: they must see it)."""
        if self._plan():
            self.close()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _ran(self, module: nn.Module, _inputs: object) -> None:
        self.ran.append(module)
        parts, has_buffers = self.needs[module]
        self._wait_for(([BUFFERS] if has_buffers else []) + parts)

    def _waiter(self, copies: list[int]) -> Callable[[nn.Module, object], None]:
        def wait(_module: nn.Module, _inputs: object) -> None:
            self._wait_for(copies)

        return wait

    def _plan(self) -> bool:
        """After the first forward: where the forward waits (`plan`), the recording hooks taken
        off; whether that is known."""
        if self.planned is None and self.ran:
            self.close()
            self.planned = plan(self.needs, self.ran)
        return self.planned is not None


class OrderedPull(ForwardWaits):
    """Copies replies into `flat`'s own storage on the device, partition by partition."""

    def __init__(self, model: nn.Module, flat: FlatModel, parts: list[tuple[int, int]]) -> None:
        super().__init__(model, parts)
        self.flat, self.parts = flat, parts
        self.stream = torch.cuda.Stream(flat.own.device)
        self.events: dict[int, torch.cuda.Event] = {}  # partition (BUFFERS: the buffers) -> its copy landed
        self.compute: torch.cuda.Stream | None = None  # the stream the forward runs on
        self.waited: set[int] = set()  # copies the compute stream waits for already

    def _wait_for(self, copies: list[int]) -> None:
        if not self.events or self.compute is None:
            return
        for j in copies:
            if j not in self.waited:
                self.compute.wait_event(self.events[j])
                self.waited.add(j)

    def load(self, vector: torch.Tensor) -> None:
        """Start copying `vector` (the reply, in pinned host memory) into the model's own
        storage; the forward waits for what each module needs."""
        self.arm()
        own, n = self.flat.own, self.flat.num_params
        self.compute = torch.cuda.current_stream(own.device)
        ready = torch.cuda.Event()
        ready.record(self.compute)  # the last backward is done with `own`
        events = {}
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            own[n:].copy_(vector[n:], non_blocking=True)
            events[BUFFERS] = torch.cuda.Event()
            events[BUFFERS].record(self.stream)
            for j, (start, end) in enumerate(self.parts):
                end = min(end, n)
                if end > start:
                    own[start:end].copy_(vector[start:end], non_blocking=True)
                events[j] = torch.cuda.Event()
                events[j].record(self.stream)
        self.events, self.waited = events, set()
        if self.flat.vector is not own:
            self.flat.adopt(own)
