"""A DataLoader's batches received from its processes in a thread, one batch ahead of the loop;
on a GPU, each batch put on the device and augmented there one batch ahead, on a side stream.

A batch a loader process made reaches the training process as shared memory: each of its
tensors' storage is handed over as a file descriptor, over a connection to that process opened
for it (torch's default sharing strategy). Receiving a batch of two tensors that way costs the
loop that takes it ~1 ms a tensor on a 2-core CPU VM, on top of its step. On a GPU worker the
DataLoader's own pin-memory thread receives each batch (and pins it) while the step runs; a
loader with processes and no pin-memory thread (a CPU worker, the PS's evaluation) gets the same
from `ReceivedAhead`: the same batches, in the same order, the loop's wait for one only where the
loader processes are behind.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

JOIN_SECONDS = 10.0  # closed early: how long the receiving thread may take to finish a receive


def wants_thread(loader: DataLoader) -> bool:
    """Whether `loader`'s batches come from processes with no pin-memory thread receiving them."""
    return loader.num_workers > 0 and not loader.pin_memory


class ReceivedAhead:
    """The items of `items` (an iterator over a DataLoader), each taken from it by a thread of
    its own while the one before is used; what `items` raises is raised here, in order.
    `close()` stops the thread: the items not yet used are dropped."""

    def __init__(self, items: Iterator[Any], depth: int = 1) -> None:
        self._items = items
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="batches-ahead", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                item: tuple[str, Any] = ("item", next(self._items))
            except StopIteration:
                item = ("end", None)
            except BaseException as error:  # raised where the loop takes its next item
                item = ("error", error)
            if not self._put(item) or item[0] != "item":
                return

    def _put(self, item: tuple[str, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> ReceivedAhead:
        return self

    def __next__(self) -> Any:
        kind, value = self._queue.get()
        if kind == "item":
            return value
        self._thread.join()  # the iterator is done with: the loader may start its next epoch
        if kind == "end":
            raise StopIteration
        raise value

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=JOIN_SECONDS)

    @property
    def receiving(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()


class DeviceBatches:
    """The batches of `batches` (one epoch, host tensors) made the model's input by `prepare`
    (the copy to `device` and whatever the dataset does there), in order, the same values. On a
    GPU one batch ahead: `prepare` of the next runs on a side stream, queued when this one is
    handed out; the compute stream waits for it on the device. On the CPU, when taken."""

    def __init__(
        self,
        batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
        prepare: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
    ) -> None:
        self.batches, self.prepare = batches, prepare
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = device
        self.ahead = self._start() if self.stream is not None else None

    def _start(self) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
        """The next batch, its preparation queued on the side stream; None after the last."""
        try:
            x, y = next(self.batches)
        except StopIteration:
            return None
        with torch.cuda.stream(self.stream):
            x, y = self.prepare(x, y)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return x, y, ready

    def __iter__(self) -> DeviceBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stream is None:
            return self.prepare(*next(self.batches))
        if self.ahead is None:
            raise StopIteration
        x, y, ready = self.ahead
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(ready)
        # made on the side stream, used on the compute stream: not reused before that is done
        x.record_stream(compute)
        y.record_stream(compute)
        self.ahead = self._start()
        return x, y
