"""The training loop's pieces that a PS worker (app.worker.trainer) and a DDP rank (app.allreduce.trainer) share:
the resumable walk over epochs and batches, a batch put on the device, and the progress report."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from app.data import datasets
from app.runtime import progress
from app.training.metrics import MetricsWriter


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
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(epoch, batch, x, y) from batch `start_batch + 1` of `start_epoch` to the end of
    `num_epochs`; batches count from 1 within an epoch, and the batches a resumed rank
    already trained on are left out by its sampler (`skip`). `before_epoch(epoch)` runs
    before each epoch's batches (a job that may be scaled: the worker's share of it)."""
    for epoch in range(start_epoch, num_epochs + 1):
        if before_epoch is not None:
            before_epoch(epoch)
        done = start_batch if epoch == start_epoch else 0
        sampler.set_epoch(epoch, skip=done * batch_size)
        for batch, (x, y) in enumerate(datasets.batches(loader, data_dir), start=done + 1):
            yield epoch, batch, x, y


def on_device(
    x: torch.Tensor, y: torch.Tensor, loader: Any, device: torch.device, memory_format: torch.memory_format
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch on `device`; images (4-d) in `memory_format`."""
    x, y = datasets.to_device(x, getattr(loader, "dataset", None), device), y.to(device, non_blocking=True)
    if x.dim() == 4:
        x = x.contiguous(memory_format=memory_format)
    return x, y


class Reporter:
    """The progress line (`<name> | Epoch: e | Batch: b | Loss: l`) and the `train` metrics
    record every --log_every batches and at an epoch's last batch, with the samples per
    second of this process and its seconds per batch (step_seconds) since the previous report."""

    def __init__(self, name: str, log_every: int, metrics: MetricsWriter | None) -> None:
        self.name, self.log_every, self.metrics = name, log_every, metrics
        self._mark = (time.monotonic(), 0, 0)  # (time, samples, batches) at the last report
        self._samples = self._batches = 0

    def batch_done(
        self, loader: DataLoader, step: int, epoch: int, batch: int, samples: int, loss: float, **fields: Any
    ) -> None:
        """Count a batch of `samples`; report it when due (`step`: the metrics record's)."""
        self._samples += samples
        self._batches += 1
        if batch % self.log_every == 0 or batch == len(loader):
            self.report(loader, step, epoch, batch, loss, **fields)

    def report(self, loader: DataLoader, step: int, epoch: int, batch: int, loss: float, **fields: Any) -> None:
        now = time.monotonic()
        then, samples_then, batches_then = self._mark
        seconds = max(now - then, 1e-9)
        rate = (self._samples - samples_then) / seconds
        step_seconds = seconds / max(self._batches - batches_then, 1)
        self._mark = (now, self._samples, self._batches)
        progress.info("%s | Epoch: %d | Batch: %d | Loss: %.2f", self.name, epoch, batch, loss)
        if self.metrics is not None:
            self.metrics.write(
                "train",
                step,
                epoch=epoch,
                batch=batch,
                loss=round(loss, 4),
                samples_per_s=round(rate, 1),
                step_seconds=round(step_seconds, 4),
                **fields,
                **datasets.skipped(loader.dataset),
            )
