"""The published PyTorch RPC batch PS example itself, timed.

`python -m bench.official --model resnet18|sleep:<C ms> --trainers 2 --warmup W
--steps N --out FILE` runs bench/vendor/pytorch_examples_batch_ps.py (vendored
verbatim) as published: `mp.spawn` of `run(rank, world_size)`, its gloo process
group, TensorPipe's default options (16 threads, every transport and channel),
the PS behind an RRef averaging one gradient of every trainer a round, the
gradients pushed as a pickled list and the whole `nn.Module` pickled back.

Patched at run time only, in each spawned process, by setting the module's
globals: CPU instead of CUDA (`.cuda()` returns its tensor or module as it is),
the model (torchvision's resnet18, or bench/sleep_model's ResNet-18 whose compute
is a sleep, in place of resnet50), 10 classes, 3x32x32 inputs, batch 20,
`batch_update_size` = the trainers (also the PS constructor's default, bound to the
published 5 when the module is read), `num_batches` = W + N, a free rendezvous port
instead of 29500 (two runs on one host must not collide), and `timed_log` records
its lines with their time instead of printing them: a trainer's "got updated
model" lines are the ends of its steps, timed as bench/gpu_report.py times every row.
Its MSE loss on one-hot labels, SGD lr 0.001 with momentum 0.9 stay as published.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SLEEP_MODEL_DIR = Path(__file__).resolve().parent / "sleep_model"


class _PortEnv(MutableMapping):
    """os.environ, except that MASTER_PORT set by the example is this run's free port."""

    def __init__(self, port: int) -> None:
        self.port = port

    def __getitem__(self, k: str) -> str:
        return os.environ[k]

    def __setitem__(self, k: str, v: str) -> None:
        os.environ[k] = str(self.port) if k == "MASTER_PORT" else v

    def __delitem__(self, k: str) -> None:
        del os.environ[k]

    def __iter__(self):
        return iter(os.environ)

    def __len__(self) -> int:
        return len(os.environ)


def _factory(model: str):
    """The example's `resnet50(num_classes=...)` replaced by the model asked for."""
    if model == "resnet18":
        from torchvision.models import resnet18

        return resnet18
    import sleep_resnet  # bench/sleep_model, on sys.path

    ms = int(model.split(":", 1)[1])
    return lambda num_classes: getattr(sleep_resnet, f"resnet18_{ms}ms")(num_classes, 3)


def _patch(example: Any, s: dict[str, Any], log: list[tuple[float, str]]) -> None:
    import torch
    from torch import nn

    torch.Tensor.cuda = lambda self, *a, **k: self  # CPU: no GPU here
    nn.Module.cuda = lambda self, *a, **k: self
    example.batch_size, example.image_w, example.image_h, example.num_classes = 20, 32, 32, 10
    example.batch_update_size = s["trainers"]
    # The PS's constructor took the published 5 as its default when the module was defined.
    example.BatchUpdateParameterServer.__init__.__defaults__ = (s["trainers"],)
    example.num_batches = s["warmup"] + s["steps"]
    example.torchvision = SimpleNamespace(models=SimpleNamespace(resnet50=_factory(s["model"])))
    example.os = SimpleNamespace(environ=_PortEnv(s["port"]))
    example.timed_log = lambda text: log.append((time.time(), text))


def _process(rank: int, world_size: int, s: dict[str, Any]) -> None:
    """One process of mp.spawn: the example's `run(rank, world_size)`, patched; then its log."""
    from bench.vendor import pytorch_examples_batch_ps as example

    log: list[tuple[float, str]] = []
    _patch(example, s, log)
    example.run(rank, world_size)
    Path(s["dir"], f"{rank}.json").write_text(json.dumps(log))


def step_ends(logs: dict[int, list[tuple[float, str]]], trainers: int) -> list[list[float]]:
    """Per trainer, the times it received the updated model: the ends of its steps."""
    return [[t for t, text in logs[r] if text == f"trainer{r} got updated model"] for r in range(1, trainers + 1)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.official", description=__doc__)
    p.add_argument("--model", default="resnet18", help="resnet18 or sleep:<C ms>")
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True, help="JSON file: each trainer's step end times")
    args = p.parse_args(argv)
    import tempfile

    import torch.multiprocessing as mp

    sys.path.insert(0, str(SLEEP_MODEL_DIR))  # the spawned processes inherit sys.path
    with tempfile.TemporaryDirectory(prefix="bench-official-") as tmp:
        s = dict(vars(args), port=free_port(), dir=tmp)
        world_size = args.trainers + 1
        mp.spawn(_process, args=(world_size, s), nprocs=world_size, join=True)
        logs = {r: json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world_size)}
    Path(args.out).write_text(json.dumps({"step_ends": step_ends(logs, args.trainers)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
