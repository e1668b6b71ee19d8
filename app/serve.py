"""The PS process: resume, serve workers, evaluate, checkpoint, end.

    resume from the newest good checkpoint (or start fresh)
    join the job (rank 0 starts the RPC group)
    until every worker finished (or the missing ones are past --join_timeout):
        wait for pushes; ping quiet workers; evaluate every --eval_every updates;
        checkpoint every --checkpoint_every updates
    save final.pt, print Accuracy, Time (training: from every worker joined to
    the last update applied) and Evaluation (the final evaluation's seconds)

On SIGTERM (or any failure) the PS checkpoints before it exits.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app import checkpoint, data, models, plugins, shards
from app.config import Config
from app.flat import FlatModel
from app.liveness import Watch
from app.metrics import MetricsWriter
from app.ps import _ENDPOINT, ParameterServer
from app.runtime import choose_device, progress, rpc_session

log = logging.getLogger("app.ps")
TICK_SECONDS = 1.0


@torch.no_grad()
def held_out_accuracy(model: nn.Module, loader: torch.utils.data.DataLoader, device: torch.device) -> tuple[float, float]:
    """Accuracy and mean loss of `model` on the held-out split (in eval mode; its mode is restored)."""
    was_training = model.training
    model.eval()
    correct, total, loss = 0, 0, 0.0
    try:
        for x, y in loader:
            x, y = data.to_device(x, loader.dataset, device), y.to(device, non_blocking=True)
            logits = model(x)
            loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(1) == y).sum().item())
            total += len(y)
    finally:
        model.train(was_training)
    return correct / total, loss / total


class Evaluator:
    """Accuracy and loss of a state vector on the held-out split, on its own model copy."""

    def __init__(self, build: Callable[[], nn.Module], loader: torch.utils.data.DataLoader,
                 device: torch.device) -> None:
        self.model = build().to(device).eval()
        self.flat = FlatModel(self.model, with_grads=False)
        self.loader, self.device = loader, device

    def __call__(self, vector: torch.Tensor) -> tuple[float, float]:
        self.flat.load(vector)
        return held_out_accuracy(self.model, self.loader, self.device)

    def state_dict(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's state dict (on CPU) holding `vector`."""
        self.flat.load(vector)
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}


class Checkpointer:
    """Periodic, on-exit and final checkpoints of one ParameterServer."""

    def __init__(self, server: ParameterServer, config: Config, identity: dict[str, Any],
                 metrics: MetricsWriter) -> None:
        self.server, self.config, self.identity, self.metrics = server, config, identity, metrics
        self.directory = Path(config.checkpoint_dir)
        self.next_version = server.version + config.checkpoint_every if config.checkpoint_every else 0
        self.saved_version = -1  # the version on disk already (written or resumed from)
        # A sharded main PS: the other shards write theirs, labelled with this version, before
        # this one is written (app.shards); raises if one could not.
        self.before_save: Callable[[int], None] = lambda version: None
        self._lock = threading.Lock()  # a finish's checkpoint comes from an RPC thread

    def resume(self) -> None:
        """Continue from the newest good checkpoint of an unfinished run of this model."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if checkpoint.remove_temp_files(self.directory):
            log.info("removed temp files of an interrupted checkpoint write in %s", self.directory)
        found = checkpoint.newest_good(self.directory)
        if found is None:
            return
        path, state = found
        defaults = {"shards": 1, "shard": 0}  # identity keys of a sharded PS (app.shards)
        expected = {**defaults, **self.identity}
        mismatch = {k: state.get(k, defaults.get(k)) for k, v in expected.items()
                    if state.get(k, defaults.get(k)) != v}
        if state["finished"] or mismatch:
            why = "it ended a finished run" if state["finished"] else f"it is of another job ({mismatch})"
            log.info("not resuming from %s: %s; starting a new run", path.name, why)
            return
        self.server.restore(state)
        self.saved_version = self.server.version
        log.info("resumed from %s: version %d", path, state["version"])
        self.metrics.write("resume", self.server.version, checkpoint=path.name)
        if self.config.checkpoint_every:
            self.next_version = self.server.version + self.config.checkpoint_every

    def due(self) -> bool:
        return 0 < self.next_version <= self.server.version

    def finished(self, rank: int) -> None:
        """Rank finished: checkpoint now (before it hears back), so a PS that crashes
        before the next periodic checkpoint does not wait for it again."""
        self.save(f"worker{rank} finished", always=True)

    def save(self, why: str, always: bool = False) -> None:
        """A periodic or on-exit checkpoint (`always`: even at the version on disk); a
        failure (disk full...) is a warning, and the checkpoints already written stay."""
        with self._lock:
            self._save(why, always)

    def _save(self, why: str, always: bool) -> None:
        state = {**self.server.checkpoint(), **self.identity}
        if state["version"] == self.saved_version and not always:
            return
        if self.config.checkpoint_every:
            self.next_version = (state["version"] // self.config.checkpoint_every + 1) * self.config.checkpoint_every
        start = time.monotonic()
        try:
            self.before_save(state["version"])
            path = checkpoint.save(state, self.directory)
        except Exception as error:  # noqa: BLE001 - disk full, read-only...: training goes on
            log.warning("checkpoint at version %d (%s) not written: %s; the earlier ones are intact",
                        state["version"], why, error)
            return
        seconds = time.monotonic() - start
        self.saved_version = state["version"]
        log.info("checkpoint %s (%s, %.2f s)", path.name, why, seconds)
        self.metrics.write("checkpoint", state["version"], file=path.name, why=why, seconds=round(seconds, 3))

    def final(self, model: dict[str, torch.Tensor] | None = None) -> None:
        """final.pt, then the last checkpoint (marked finished); OSError naming the file
        if one fails. A finished checkpoint therefore always has its final.pt; if only
        final.pt was written, a restart resumes the (unfinished) run and writes both.

        `model`: the whole model's state dict, for a sharded PS whose own state is a slice."""
        state = {**self.server.checkpoint(), **self.identity}
        final = self.directory / "final.pt"
        saved = state
        if model is not None:
            saved = {k: v for k, v in state.items() if k not in ("vector", "part", "optimizer")}
            saved["model"] = model
        with self._lock:
            try:
                checkpoint.save_atomically(saved, final)
            except OSError as error:
                raise OSError(f"{final} not written ({error.strerror or error}); "
                              "no checkpoint was marked finished") from None
            log.info("saved %s (version %d)", final, state["version"])
            checkpoint.save(state, self.directory)


def serve(config: Config) -> int:
    """The PS process; 0 when training ended, 1 when no worker ever finished."""
    if config.shard:
        return shards.serve_shard(config)
    device = choose_device(config.device)  # evaluation only; updates stay on CPU for RPC
    models.check(config.model)
    held_out = data.load(config.dataset, config.data_dir, "test", config.seed, config.image_size, config.image_cache)
    log.info("held-out split: %s", data.describe(held_out))

    def build() -> nn.Module:
        return models.build(config.model, held_out.channels, held_out.num_classes, config.seed)

    model = build()
    if config.init_weights:  # before the PS copies the model; a checkpoint to resume wins
        plugins.load_weights(model, config.init_weights)
    part = shards.bounds(shards.state_size(model), config.shards)[0] if config.shards > 1 else None
    server = ParameterServer(model, config.lr, config.momentum, config.num_trainers, config.join_timeout,
                             strategy=config.strategy, staleness=config.staleness,
                             staleness_lr=config.staleness_lr, part=part)
    evaluate = Evaluator(build, data.eval_loader(held_out.data, config.batch_size, config.num_workers), device)
    log.info("model %s: %d parameters, %d buffer values", config.model,
             server.flat.num_params, server.flat.num_buffers)
    # `trainer: ps` keeps a PS from resuming an allreduce job's checkpoint (app.ddp).
    identity = dict(model_name=config.model, dataset=config.dataset, channels=held_out.channels,
                    num_classes=held_out.num_classes, world_size=config.world_size, trainer="ps")
    if part is not None:
        identity.update(shards=config.shards, shard=0)
        log.info("shard 0 of %d: values %d..%d of %d", config.shards, *part, server.flat.size)
    with MetricsWriter(config.metrics_dir, "ps", "ps", 0) as metrics:
        checkpoints = Checkpointer(server, config, identity, metrics)
        checkpoints.resume()
        server.on_finish = checkpoints.finished
        watch = Watch(server, config.rpc_timeout, metrics.write)
        others = shards.ShardSet(config.shards, server.flat.size, config, metrics.write) \
            if part is not None else None
        join = watch.join
        if others is not None:
            watch.on_drop = others.drop
            join = functools.partial(others.join, watch.join)
            checkpoints.before_save = others.checkpoint
        resumed = checkpoints.saved_version if checkpoints.saved_version >= 0 else None
        with _ENDPOINT.serving(server, join=join), shards.main_serving(others, resumed), \
                rpc_session(config, rank=0):
            try:
                train_until_done(server, watch, checkpoints, evaluate, metrics, config, others)
            except BaseException:  # SIGTERM (SystemExit) or a failure: keep what was learned
                checkpoints.save("on exit")
                raise
            if not server.roster.all_finished:
                log.warning("ending without %s: not back within --join_timeout %.0f s",
                            ", ".join(f"rank {m.rank}" for m in server.roster.missing()), config.join_timeout)
            if not server.finished:
                log.error("no worker finished its epochs; nothing to save as final")
                if others is not None:
                    others.end(finished=False)
                return 1
            if others is None:
                checkpoints.final()
            else:
                vector, version = _gather_final(server, others, config.rpc_timeout)
                checkpoints.final(evaluate.state_dict(vector))
                others.end(finished=server.all_finished)
        if others is None:
            vector, version = server.snapshot()
        evaluated = time.monotonic()
        accuracy, loss = evaluate(vector)
        eval_seconds = time.monotonic() - evaluated
        seconds = server.training_seconds() or 0.0
        progress.info("Accuracy: %.4f", accuracy)
        progress.info("Time: %.2f seconds", seconds)
        progress.info("Evaluation: %.2f seconds", eval_seconds)
        metrics.write("end", version, accuracy=round(accuracy, 4), loss=round(loss, 4),
                      seconds=round(seconds, 2), eval_seconds=round(eval_seconds, 2),
                      samples=server.samples, strategy=config.strategy, **server.stats(), **data.skipped(held_out.data))
    return 0


def _gather_final(server: ParameterServer, others: shards.ShardSet, timeout: float) -> tuple[torch.Tensor, int]:
    """The whole trained vector from every shard, retried for up to `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        own, version = server.snapshot()
        vector = others.gather(own)
        if vector is not None:
            return vector, version
        if time.monotonic() > deadline:
            raise RuntimeError(f"the shards' values could not be gathered within {timeout:.0f} s; "
                               "final.pt not written")
        time.sleep(1.0)


def train_until_done(server: ParameterServer, watch: Watch, checkpoints: Checkpointer,
                     evaluate: Evaluator, metrics: MetricsWriter, config: Config,
                     others: shards.ShardSet | None = None) -> None:
    """Serve until every worker finished, or the missing ones are past --join_timeout."""
    next_eval = (server.version // config.eval_every + 1) * config.eval_every
    while not server.done():
        wake_at = min(next_eval, checkpoints.next_version or next_eval)
        server.wait(wake_at, timeout=TICK_SECONDS)
        watch.tick()
        if others is not None:
            others.tick()
        server.unblock()
        if server.version >= next_eval and not server.all_finished:
            vector, version = server.snapshot()
            if others is not None:
                vector = others.gather(vector)  # None: a shard did not answer (one warning)
            if vector is not None:
                accuracy, loss = evaluate(vector)
                progress.info("ps | Update: %d | Accuracy: %.4f", version, accuracy)
                metrics.write("eval", version, accuracy=round(accuracy, 4), loss=round(loss, 4),
                              samples=server.samples)
            next_eval = (version // config.eval_every + 1) * config.eval_every
        if checkpoints.due():
            checkpoints.save("every %d updates" % config.checkpoint_every)
