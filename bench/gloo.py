"""The bound of the wire: a Gloo send + recv of the same bytes as a push + pull.

Each worker sends a message of the model's state size to rank 0 and receives
one back; rank 0 answers whoever sent, until every worker sent its stop
message (a NaN in front).
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bench import loop


def _init(p: dict[str, Any], rank: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{p['port']}",
        rank=rank,
        world_size=p["world_size"],
        timeout=timedelta(seconds=120),
    )


def ps_main(p: dict[str, Any]) -> dict[str, Any]:
    _init(p, 0)
    buf, state = torch.empty(p["floats"]), torch.randn(p["floats"])
    stopped, served = 0, 0
    while stopped < p["world_size"] - 1:
        src = dist.recv(buf)
        if math.isnan(buf[0].item()):
            stopped += 1
            continue
        dist.send(state, dst=src)
        served += 1
    dist.destroy_process_group()
    return {"served": served}


def worker_main(p: dict[str, Any]) -> dict[str, Any]:
    _init(p, p["rank"])
    message, state = torch.randn(p["floats"]), torch.empty(p["floats"])

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        dist.send(message, dst=0)
        dist.recv(state, src=0)
        return 0.0, time.perf_counter() - t0

    result = loop.run_window(step, p["warmup"], p["seconds"], p["tail"])
    message[0] = float("nan")
    dist.send(message, dst=0)
    dist.destroy_process_group()
    result.update(compute_only_s=None, push_bytes=4 * p["floats"], pull_bytes=4 * p["floats"])
    return result
