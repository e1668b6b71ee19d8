"""The two baselines of the headline table, workers only (no rank 0 process: `workers_only`).

`compute`: each worker runs forward + backward on its fixed batch and nothing
else, all workers at once: the step a PS strategy is compared against.
`allreduce`: the workers train with DistributedDataParallel over Gloo, the
step of the app's `--strategy allreduce` (forward, backward with DDP's
gradient allreduce, SGD at lr 0.01): the comparison without a PS.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench import loop
from bench.models import SPECS


def worker_main(p: dict[str, Any]) -> dict[str, Any]:
    spec = SPECS[p["model"]]
    x, y = spec.batch(seed=p["rank"])
    model, loss_fn = spec.model(), nn.CrossEntropyLoss()
    optimizer = None
    if p.get("allreduce"):
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{p['port']}",
            rank=p["rank"] - 1,
            world_size=p["world_size"] - 1,
            timeout=timedelta(seconds=p["timeout"]),
        )
        model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()
        if optimizer is not None:
            optimizer.step()
        return time.perf_counter() - t0, 0.0

    result = loop.run(step, p, lockstep=optimizer is not None)
    if optimizer is not None:
        dist.destroy_process_group()
    params = sum(q.numel() for q in model.parameters())
    result.update(
        compute_only_s=None, push_bytes=4 * params if optimizer else 0, pull_bytes=4 * params if optimizer else 0
    )
    return result
