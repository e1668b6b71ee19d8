"""The PS's update of one async push, alone: `ParameterServer.submit` of the app's PS (under
the lock the SGD step into the pusher's reply buffer, and the answer) of a push whose worker
proved it finite, as every worker's backward does (app.training.flat's `finite_proof`, a GPU's
flags), so the PS does not check it again; the NaN/inf check a push without that proof costs
the PS is measured beside it. In this process, on the sleep model's state (ResNet-18's
44.8 MB), with the threads a PS process of the bench's jobs takes. No message moves: it is the
work that lies on a plain async worker's path between its push and its next forward where the
answer waits for the whole update (a GPU worker's), so no such step is shorter than compute
alone plus it (`python -m bench gpu` prints that floor under each C). A CPU worker's answer is
streamed (app.exchange.streamed_pull): it goes once the first partition is written, and its
step may be shorter.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

WORKERS = 2  # two ranks push in turn, each into its own reply buffer, as two workers' pushes do


def measure(code: str, repeats: int = 20) -> dict[str, Any]:
    """Median seconds of the whole update (`update_s`) and of its NaN/inf check (`check_s`) over
    `repeats` pushes after two untimed ones, the `threads` they ran with and the `pushes` the PS
    applied; the bench's own thread count is put back after. `code`: the sleep model's directory."""
    from app.config import parse
    from app.runtime import machine

    if code not in sys.path:
        sys.path.insert(0, code)
    config = parse(["ps", "--world_size", str(WORKERS + 1), "--lr", "0.01"], {})
    threads = torch.get_num_threads()
    used = machine.set_threads(machine.sharing_cpus(config))
    try:
        return dict(_timed(config, repeats), threads=used)
    finally:
        torch.set_num_threads(threads)


def _timed(config: Any, repeats: int) -> dict[str, Any]:
    import sleep_resnet

    from app.exchange.wire import Push
    from app.ps.server import ParameterServer, ServerConfig

    model = sleep_resnet.resnet18_0ms(10, 3)
    server = ParameterServer(model, ServerConfig.from_config(config))
    ranks = range(1, WORKERS + 1)
    for rank in ranks:
        server.join(rank, f"worker{rank}")
    message = torch.randn(server.state.size).mul_(1e-4)
    updates, checks = [], []
    for i in range(repeats + 2):
        rank = ranks[i % WORKERS]
        push = Push(rank, f"worker{rank}", server.version, batch=i + 1, samples=20, finite=True)
        started = time.perf_counter()
        future = server.submit(push, message)
        updated = time.perf_counter()
        server.state.finite(message)
        checked = time.perf_counter()
        if not future.done():
            raise RuntimeError("an async push was not answered at once")
        updates.append(updated - started)
        checks.append(checked - updated)
    return {
        "update_s": statistics.median(updates[2:]),
        "check_s": statistics.median(checks[2:]),
        "pushes": server.version,
    }
