"""The training loop's pieces that a PS worker (app.worker.trainer) and a DDP rank (app.allreduce.trainer) share:
the resumable walk over epochs and batches, a batch put on the device, and the progress report."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from app.data import datasets
from app.data.prefetch import DeviceBatches
from app.runtime.logs import progress
from app.training.metrics import MetricsWriter

Batch = tuple[torch.Tensor, torch.Tensor]


class ResumableSampler(Protocol):
    """A sampler that can leave out the first `skip` indices of an epoch."""

    def set_epoch(self, epoch: int, skip: int = 0) -> None: ...


def resume_batches(
    loader: DataLoader,
    sampler: ResumableSampler,
    data_dir: str,
    start_epoch: int,
    start_batch: int,
    num_epochs: int,
    batch_size: int,
    before_epoch: Callable[[int], None] | None = None,
    on_device: Callable[[Iterator[Batch]], Iterator[Batch]] | None = None,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(epoch, batch, x, y) from batch `start_batch + 1` of `start_epoch` to the end of
    `num_epochs`; batches count from 1 within an epoch, and the batches a resumed rank
    already trained on are left out by its sampler (`skip`). `before_epoch(epoch)` runs
    before each epoch's batches (a job that may be scaled: the worker's share of it).
    `on_device` turns an epoch's batches into the model's inputs on its device (`DeviceBatches`)."""
    for epoch in range(start_epoch, num_epochs + 1):
        if before_epoch is not None:
            before_epoch(epoch)
        done = start_batch if epoch == start_epoch else 0
        sampler.set_epoch(epoch, skip=done * batch_size)
        batches = datasets.batches(loader, data_dir)
        for batch, (x, y) in enumerate(on_device(batches) if on_device else batches, start=done + 1):
            yield epoch, batch, x, y


def epoch_batches(loader: DataLoader, batch_size: int) -> int:
    """The batches of one epoch over the whole training split at `batch_size` (whoever trains
    them): what a run's schedule is planned by (app/recipes.py planned_updates); 0 for a
    dataset without a length (or no loader: a trainer driven batch by batch)."""
    try:
        return math.ceil(len(loader.dataset) / batch_size)  # type: ignore[arg-type]
    except (TypeError, AttributeError):
        return 0


def length(loader: DataLoader) -> int | None:
    """len(loader), or None for a stream without a declared length."""
    try:
        return len(loader)
    except TypeError:
        return None


def on_device(
    x: torch.Tensor, y: torch.Tensor, loader: Any, device: torch.device, memory_format: torch.memory_format
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch on `device`; images (4-d) in `memory_format`."""
    x, y = datasets.to_device(x, getattr(loader, "dataset", None), device), y.to(device, non_blocking=True)
    if x.dim() == 4:
        x = x.contiguous(memory_format=memory_format)
    return x, y


def device_batches(
    loader: Any, device: torch.device, memory_format: torch.memory_format
) -> Callable[[Iterator[Batch]], Iterator[Batch]]:
    """What turns an epoch of `loader`'s batches into the model's inputs on `device` (`on_device`):
    on a GPU one batch ahead, on a side stream, while the step before it computes
    (app.data.prefetch.DeviceBatches); on the CPU each as it is taken."""

    def prepare(x: torch.Tensor, y: torch.Tensor) -> Batch:
        return on_device(x, y, loader, device, memory_format)

    def batches(epoch: Iterator[Batch]) -> Iterator[Batch]:
        return DeviceBatches(epoch, prepare, device)

    return batches


class Loss:
    """A step's loss as the host reads it. On the CPU the loss itself. On a GPU a copy into pinned
    host memory queued on the compute stream after the backward (no `.item()`, which would wait
    for the whole step): it is read only after a wait the step makes anyway, the push's copies
    landing, which come after it on the GPU (the Reporter writes a report one step late)."""

    def __init__(self, value: torch.Tensor, ready: bool) -> None:
        self.value, self.ready = value, ready

    def __float__(self) -> float:
        return float(self.value)


class Losses:
    """A few pinned scalars the steps' losses are copied into in turn (a report reads one a
    step after it was copied)."""

    def __init__(self, device: torch.device, depth: int = 4) -> None:
        self.pinned = torch.zeros(depth, pin_memory=True) if device.type == "cuda" else None
        self.taken = 0

    def take(self, loss: torch.Tensor) -> Loss:
        if self.pinned is None:
            return Loss(loss.detach(), ready=True)
        value = self.pinned[self.taken % len(self.pinned)]
        self.taken += 1
        value.copy_(loss.detach().float(), non_blocking=True)  # pinned: queued, no host wait
        return Loss(value, ready=False)


class Reporter:
    """The progress line (`<name> | Epoch: e | Batch: b | Loss: l | r samples/s`) and the `train` metrics
    record every --log_every batches and at an epoch's last batch, with the samples per
    second of this process and its seconds per batch (step_seconds) since the previous report.
    A loss still on its way from the GPU (`Loss.ready` false) is reported with the next batch
    (or by `flush`), once the next step's kernels are launched and the wait for its push past."""

    def __init__(self, name: str, log_every: int, metrics: MetricsWriter | None) -> None:
        self.name, self.log_every, self.metrics = name, log_every, metrics
        self._mark = (time.monotonic(), 0, 0)  # (time, samples, batches) at the last report
        self._samples = self._batches = 0
        self._held: Callable[[], None] | None = None  # a report waiting for its loss
        self._unsent: tuple[float, float] | None = None  # the last report's loss and samples/s, for the PS

    def batch_done(
        self, loader: DataLoader, step: int, epoch: int, batch: int, samples: int, loss: float | Loss, **fields: Any
    ) -> None:
        """Count a batch of `samples`; report it when due (`step`: the metrics record's)."""
        self._samples += samples
        self._batches += 1
        self.flush()
        if batch % self.log_every == 0 or batch == length(loader):
            write = self.report(loader, step, epoch, batch, loss, **fields)
            if isinstance(loss, Loss) and not loss.ready:
                self._held = write
            else:
                write()

    def flush(self) -> None:
        """Write the report held for its loss (the wait that makes it readable has passed)."""
        held, self._held = self._held, None
        if held is not None:
            held()

    def take(self) -> tuple[float, float] | None:
        """The last report's loss and samples/s, once (the next push carries them to the PS,
        which logs them to MLflow); None when none was written since."""
        unsent, self._unsent = self._unsent, None
        return unsent

    def report(
        self, loader: DataLoader, step: int, epoch: int, batch: int, loss: float | Loss, **fields: Any
    ) -> Callable[[], None]:
        """The report of this batch, measured now, to write once its loss can be read."""
        now = time.monotonic()
        then, samples_then, batches_then = self._mark
        seconds = max(now - then, 1e-9)
        rate = (self._samples - samples_then) / seconds
        step_seconds = seconds / max(self._batches - batches_then, 1)
        self._mark = (now, self._samples, self._batches)
        skipped = datasets.skipped(loader.dataset)

        def write() -> None:
            value = float(loss)
            self._unsent = (round(value, 4), round(rate, 1))
            progress.info(
                "%s | Epoch: %d | Batch: %d | Loss: %.2f | %.0f samples/s", self.name, epoch, batch, value, rate
            )
            if self.metrics is not None:
                self.metrics.write(
                    "train",
                    step,
                    epoch=epoch,
                    batch=batch,
                    loss=round(value, 4),
                    samples_per_s=round(rate, 1),
                    step_seconds=round(step_seconds, 4),
                    **fields,
                    **skipped,
                )

        return write
