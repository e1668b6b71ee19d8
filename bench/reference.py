"""A reference PS written the way the PyTorch RPC batch example does it.

pytorch/examples distributed/rpc/batch/parameter_server.py, kept as it is
(with `batch_update_size` 1, so every push is an update, as in the app's
async SGD): the PS object lives behind an RRef, a push is a list of
gradient tensors pickled over RPC, `p.grad += g` outside the lock, the
optimizer steps, and the whole `nn.Module` is pickled back to the worker;
the PS drives the trainers with `rpc_async`; TensorPipe default options
(shm transport included) and torch's default thread count. Only the timing
and the model/batch (bench.models) are the bench's. `ref-tuned` runs the
same code with the app's process settings (uv transport, cores/world threads),
to separate what the code costs from what the defaults cost.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn, optim

from bench import loop
from bench.models import SPECS

RPC_TIMEOUT = 300


class BatchUpdateParameterServer:
    def __init__(self, model: nn.Module, batch_update_size: int = 1) -> None:
        self.model = model
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.01)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self) -> nn.Module:
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref: rpc.RRef, grads: list[torch.Tensor]) -> torch.futures.Future:
        self = ps_rref.local_value()
        for p, g in zip(self.model.parameters(), grads):
            p.grad += g
        with self.lock:
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


def run_trainer(ps_rref: rpc.RRef, p: dict[str, Any]) -> dict[str, Any]:
    """The example's Trainer.train, timed."""
    spec = SPECS[p["model"]]
    x, y = spec.batch(seed=p["rank"])
    loss_fn = nn.CrossEntropyLoss()
    m = ps_rref.rpc_sync().get_model()

    def compute() -> None:
        loss_fn(m(x), y).backward()

    compute_only = loop.time_compute(compute, p["compute_seconds"])
    for q in m.parameters():
        q.grad = None

    def step() -> tuple[float, float]:
        nonlocal m
        t0 = time.perf_counter()
        loss_fn(m(x), y).backward()
        t1 = time.perf_counter()
        m = rpc.rpc_sync(ps_rref.owner(), BatchUpdateParameterServer.update_and_fetch_model,
                         args=(ps_rref, [q.grad for q in m.cpu().parameters()]))
        return t1 - t0, time.perf_counter() - t1

    result = loop.run_window(step, p["warmup"], p["seconds"], p["tail"])
    if p.get("idle_marker"):
        Path(p["idle_marker"]).touch()
        time.sleep(p["idle_seconds"])
    push = sum(q.numel() * q.element_size() for q in m.parameters())
    pull = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    result.update(compute_only_s=compute_only, push_bytes=push, pull_bytes=pull)
    return result


def _init(name: str, rank: int, p: dict[str, Any]) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(p["port"])
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=RPC_TIMEOUT)
    if p.get("tuned"):  # `ref-tuned`: the same code with the app's process settings
        options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=RPC_TIMEOUT,
                                                  _transports=["uv"], _channels=["mpt_uv", "basic"])
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // p["world_size"]))
    rpc.init_rpc(name, rank=rank, world_size=p["world_size"], rpc_backend_options=options)


def ps_main(p: dict[str, Any]) -> dict[str, Any]:
    _init("ps", 0, p)
    ps_rref = rpc.RRef(BatchUpdateParameterServer(SPECS[p["model"]].model()))
    futs = [rpc.rpc_async(f"trainer{r}", run_trainer, args=(ps_rref, dict(p, rank=r, idle_marker=p["idle_marker"] if r == 1 else None)))
            for r in range(1, p["world_size"])]
    results = torch.futures.wait_all(futs)
    rpc.shutdown()
    return {"workers": {str(r): res for r, res in enumerate(results, start=1)}}


def worker_main(p: dict[str, Any]) -> dict[str, Any]:
    _init(f"trainer{p['rank']}", p["rank"], p)
    rpc.shutdown()
    return {}
