"""A GPU worker's step runs ahead of its GPU (app.worker.trainer, app.exchange.slot_copies,
backward_copies, ordered_pull, app.data.prefetch, app.data.augment): N steps of each PS strategy
with torch.cuda.set_sync_debug_mode("error"), so any call that makes the host wait for the GPU
(`.item()`, a stream's synchronize, a synchronous copy) fails the step, and with every host
copy to or from the device checked to use pinned memory (the debug mode does not see a copy
from pageable memory, which waits for the stream all the same). The waits the step keeps are
event waits in the sender thread, which the GPU does not notice. Needs a CUDA GPU:
skipped elsewhere."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torchvision
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

from app.config import parse
from app.contract import PS
from app.exchange.ps_end import SharedExchange
from app.exchange.route import Pusher
from app.exchange.shared_route import SharedMemoryRoute
from app.exchange.wire import Start, finite_flag
from app.ps.rpc import Endpoint
from app.training import loop
from app.training.flat import FlatModel
from app.worker.channels import PSChannel
from app.worker.trainer import Trainer

import needs
from app_testkit import ps_server

pytestmark = needs.cuda_gpu()
CUDA = torch.device("cuda")


@pytest.fixture
def shm_dir(tmp_path):
    path = Path("/dev/shm") / f"test-psc-{os.getpid()}-{tmp_path.name}"
    path.mkdir()
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


class Images(Dataset):
    """uint8 images of the image cache's kind, augmented on the device (app.data.augment)."""

    def __init__(self, n: int = 64, size: int = 72, crop: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.crop = crop

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def on_device(self, batch: torch.Tensor) -> torch.Tensor:
        from app.data.augment import augment

        return augment(batch, True, self.crop)


def in_process(to, function, args, timeout):
    """A route's call (app.exchange.route.Call) served by the PS in this process (no RPC)."""
    return function(*args)


@contextlib.contextmanager
def no_pageable_copies() -> Iterator[list[str]]:
    """Fail any Tensor.to / Tensor.copy_ between the host and the GPU whose host side is not
    pinned (as vLLM's sync debugging wraps them)."""
    seen: list[str] = []
    real_to, real_copy = torch.Tensor.to, torch.Tensor.copy_

    def check(host: torch.Tensor, other: torch.Tensor, what: str) -> None:
        if host.device.type == "cpu" and other.device.type == "cuda" and not host.is_pinned():
            seen.append(f"{what} of {tuple(host.shape)} {host.dtype} from/to pageable memory")
            raise AssertionError(seen[-1])

    def to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.device != self.device:
            check(self if self.device.type == "cpu" else out, out if self.device.type == "cpu" else self, "to")
        return out

    def copy_(self, src, non_blocking=False):
        if self.device != src.device:
            check(src if src.device.type == "cpu" else self, self if src.device.type == "cpu" else src, "copy_")
        return real_copy(self, src, non_blocking)

    torch.Tensor.to, torch.Tensor.copy_ = to, copy_  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        torch.Tensor.to, torch.Tensor.copy_ = real_to, real_copy  # type: ignore[method-assign]


@pytest.mark.parametrize("strategy,overlap", [("async", False), ("async", True), ("sync", False), ("ssp", False)])
def test_n_steps_of_a_gpu_worker_never_wait_for_the_gpu_on_the_host(shm_dir, strategy, overlap):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    ps_model = torchvision.models.resnet18(num_classes=10)
    ps_model.load_state_dict(model.state_dict())
    size = FlatModel(ps_model, with_grads=False).size
    exchange = SharedExchange.open(str(shm_dir), size, 1, overlap=overlap, sync=strategy == "sync")
    staleness = 2 if strategy == "ssp" else 0
    server = ps_server(ps_model, lr=0.01, strategy=strategy, staleness=staleness, shared=exchange)
    argv = ["worker", "--device", "cuda", "--strategy", strategy, "--overlap", str(overlap).lower()]
    config = parse(argv, {})
    data = Images()
    loader = DataLoader(data, sampler=BatchSampler(SequentialSampler(data), 16, True), batch_size=None, pin_memory=True)
    try:
        with Endpoint(server).serving():
            joined = server.join(1, "worker1")
            channel = PSChannel(1, 30.0, "in-process", "worker1", device=CUDA, overlap=overlap)
            pusher = Pusher(1, "worker1", "in-process", 30.0, CUDA, overlap)
            channel.route = end = SharedMemoryRoute.attach(exchange.offer(), pusher, PS, 0, size, call=in_process)
            trainer = Trainer(config, model.to(CUDA), loader, None, CUDA, channel, None)
            trainer.start_from(Start(joined.vector, joined.version, joined.progress))
            batches = loop.device_batches(loader, CUDA, torch.contiguous_format)
            steps = 0
            for epoch in range(3):
                for x, y in batches(iter(loader)):
                    if steps == 3:  # warmed up: cuDNN's choices made, the first backward counted
                        torch.cuda.synchronize()
                        torch.cuda.set_sync_debug_mode("error")
                        pageable = no_pageable_copies()
                        pageable.__enter__()
                    loss = trainer.compute_gradients(x, y)
                    trainer.push_and_pull(epoch + 1, steps, len(y))
                    trainer.reporter.batch_done(loader, trainer.pushes, epoch + 1, steps + 1, len(y), loss)
                    steps += 1
            torch.cuda.set_sync_debug_mode("default")
            pageable.__exit__(None, None, None)
            trainer.last_reply()
            assert steps == 12 and trainer.pushes == steps and trainer.refused == 0
            assert end.outbound is not None and end.outbound.on  # copied out as each backward finished it
            assert torch.isfinite(trainer.flat.own).all()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        exchange.close()


def test_device_flags_say_finite_on_the_gpu_without_a_host_wait():
    values = torch.randn(1 << 20, device=CUDA)
    torch.cuda.set_sync_debug_mode("error")
    try:
        good = finite_flag(values)
        values[5] = float("nan")
        bad = finite_flag(values)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert good.is_cuda and bool(good) and not bool(bad)
