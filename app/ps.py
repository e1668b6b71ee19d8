"""The Parameter Server: global model, SGD under a lock, version and staleness.

`ParameterServer` is plain Python (tested without RPC); `rpc_*` are the entry
points workers call; `serve` is the PS process. The PS never calls a worker:
workers pull, push and report, so a dead worker can only stop calling.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app import data, models
from app.config import Config
from app.flat import FlatModel
from app.metrics import MetricsWriter
from app.runtime import choose_device, progress, rpc_session

log = logging.getLogger("app.ps")


class ParameterServer:
    """Owns the global state vector [params | buffers] and applies pushed gradients.

    A push is `[grads | buffers]` as one flat tensor: SGD steps the parameters,
    and the buffers (BatchNorm running stats) replace the global ones. Every
    worker starts each forward from the buffers it received, so the running
    stats form one moving average over all workers' batches, delayed like the
    parameters.
    """

    def __init__(self, model: nn.Module, lr: float, momentum: float, num_workers: int,
                 notify_every: int = 0) -> None:
        self.model = model
        self.flat = FlatModel(model, with_grads=False)
        self._param = nn.Parameter(self.flat.params)  # shares storage with the model
        self.optimizer = torch.optim.SGD([self._param], lr=lr, momentum=momentum)
        self.num_workers = num_workers
        self.notify_every = notify_every
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.version = 0
        self.pushes: dict[int, int] = {}
        self.finished: dict[int, int] = {}  # rank -> pushes the worker counted
        self.staleness_sum = 0
        self.staleness_max = 0

    def pull(self, rank: int) -> tuple[torch.Tensor, int]:
        """A copy of the state vector and its version."""
        with self._lock:
            return self.flat.vector.clone(), self.version

    def push(self, rank: int, message: torch.Tensor, pulled_version: int) -> tuple[torch.Tensor, int, int]:
        """Apply one worker's `[grads | buffers]`; return (fresh state, version, staleness)."""
        if message.numel() != self.flat.size or message.dtype != self.flat.vector.dtype:
            raise ValueError(f"worker{rank} pushed {message.numel()} {message.dtype} values; "
                             f"the model has {self.flat.size} {self.flat.vector.dtype}")
        n = self.flat.num_params
        with self._lock:
            self._param.grad = message[:n]
            self.optimizer.step()
            self._param.grad = None
            self.flat.vector[n:].copy_(message[n:])
            staleness = self.version - pulled_version
            self.version += 1
            self.pushes[rank] = self.pushes.get(rank, 0) + 1
            self.staleness_sum += staleness
            self.staleness_max = max(self.staleness_max, staleness)
            if self.notify_every and self.version % self.notify_every == 0:
                self._changed.notify_all()
            return self.flat.vector.clone(), self.version, staleness

    def finish(self, rank: int, pushes: int) -> None:
        """A worker has run all its epochs."""
        with self._lock:
            self.finished[rank] = pushes
            self._changed.notify_all()
        log.info("worker%d finished after %d pushes (%d/%d done)", rank, pushes,
                 len(self.finished), self.num_workers)

    @property
    def all_finished(self) -> bool:
        return len(self.finished) >= self.num_workers

    def wait(self, until_version: int, timeout: float) -> None:
        """Block until every worker finished, the version reaches `until_version`, or timeout."""
        with self._changed:
            self._changed.wait_for(lambda: self.all_finished or self.version >= until_version, timeout)

    def snapshot(self) -> tuple[torch.Tensor, int]:
        return self.pull(rank=0)

    def checkpoint(self) -> dict[str, Any]:
        """Model, optimizer and version, copied under the lock."""
        with self._lock:
            return {
                "version": self.version,
                "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "optimizer": _clone_tree(self.optimizer.state_dict()),
                "pushes": dict(self.pushes),
            }

    def stats(self) -> dict[str, Any]:
        with self._lock:
            mean = self.staleness_sum / self.version if self.version else 0.0
            return {"pushes": {f"worker{r}": n for r, n in sorted(self.pushes.items())},
                    "staleness_mean": round(mean, 3), "staleness_max": self.staleness_max}


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tree(v) for v in obj]
    return obj


class _Endpoint:
    """Where RPC calls find this process's ParameterServer.

    RPC runs plain functions by name, so the serving object has to be
    reachable from them: this holder is the app's one piece of process-wide
    state, set only for the duration of `serving()`.
    """

    def __init__(self) -> None:
        self._server: ParameterServer | None = None

    @contextmanager
    def serving(self, server: ParameterServer) -> Iterator[ParameterServer]:
        self._server = server
        try:
            yield server
        finally:
            self._server = None

    def get(self) -> ParameterServer:
        if self._server is None:
            raise RuntimeError("no parameter server is serving in this process")
        return self._server


_ENDPOINT = _Endpoint()


def rpc_pull(rank: int) -> tuple[torch.Tensor, int]:
    return _ENDPOINT.get().pull(rank)


def rpc_push(rank: int, message: torch.Tensor, pulled_version: int) -> tuple[torch.Tensor, int, int]:
    return _ENDPOINT.get().push(rank, message, pulled_version)


def rpc_finish(rank: int, pushes: int) -> None:
    _ENDPOINT.get().finish(rank, pushes)


def rpc_all_finished() -> bool:
    return _ENDPOINT.get().all_finished


class Evaluator:
    """Accuracy and loss of a state vector on the held-out split, on its own model copy."""

    def __init__(self, build: Callable[[], nn.Module], loader: torch.utils.data.DataLoader,
                 device: torch.device) -> None:
        self.model = build().to(device).eval()
        self.flat = FlatModel(self.model, with_grads=False)
        self.loader, self.device = loader, device

    @torch.no_grad()
    def __call__(self, vector: torch.Tensor) -> tuple[float, float]:
        self.flat.load(vector)
        correct, total, loss = 0, 0, 0.0
        for x, y in self.loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            logits = self.model(x)
            loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(1) == y).sum().item())
            total += len(y)
        return correct / total, loss / total


def save_atomically(obj: Any, path: Path) -> None:
    """torch.save to a temp file in the same directory, fsync, rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def serve(config: Config) -> int:
    """The PS process: serve pushes until every worker finished, then evaluate and save."""
    device = choose_device(config.device)  # evaluation only; updates stay on CPU for RPC
    models.check(config.model)
    held_out = data.load(config.dataset, config.data_dir, "test", config.seed)
    log.info("held-out split: %s", data.describe(held_out))

    def build() -> nn.Module:
        return models.build(config.model, held_out.channels, held_out.num_classes, config.seed)

    server = ParameterServer(build(), config.lr, config.momentum, config.num_trainers,
                             notify_every=config.eval_every)
    evaluate = Evaluator(build, data.eval_loader(held_out.data, config.batch_size, config.num_workers), device)
    log.info("model %s: %d parameters, %d buffer values", config.model,
             server.flat.num_params, server.flat.num_buffers)
    with MetricsWriter(config.metrics_dir, "ps", "ps", 0) as metrics:
        with _ENDPOINT.serving(server), rpc_session(config, rank=0):
            start = time.monotonic()
            next_eval = config.eval_every
            while not server.all_finished:
                server.wait(next_eval, timeout=5.0)
                if server.version >= next_eval and not server.all_finished:
                    vector, version = server.snapshot()
                    accuracy, loss = evaluate(vector)
                    progress.info("ps | Update: %d | Accuracy: %.4f", version, accuracy)
                    metrics.write("eval", version, accuracy=round(accuracy, 4), loss=round(loss, 4))
                    next_eval = (version // config.eval_every + 1) * config.eval_every
            state = server.checkpoint()
            state.update(model_name=config.model, dataset=config.dataset,
                         channels=held_out.channels, num_classes=held_out.num_classes)
            final = Path(config.checkpoint_dir) / "final.pt"
            save_atomically(state, final)
            log.info("saved %s (version %d)", final, state["version"])
        vector, version = server.snapshot()
        accuracy, loss = evaluate(vector)
        seconds = time.monotonic() - start
        progress.info("Accuracy: %.4f", accuracy)
        progress.info("Time: %.2f seconds", seconds)
        metrics.write("end", version, accuracy=round(accuracy, 4), loss=round(loss, 4),
                      seconds=round(seconds, 2), **server.stats())
    return 0
