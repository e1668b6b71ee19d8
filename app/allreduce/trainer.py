"""One rank's training in an allreduce job: where the job is (`Progress`, `JobState`, which a
Checkpointer saves), each epoch's samples of this rank (`EpochSampler`), and the loop
(`AllreduceTrainer`): forward, backward (DDP averages the gradients), SGD step; rank 0 also
evaluates every --eval_every steps (in a background thread, on a copy of the weights, so the
others never wait for it in their next allreduce) and checkpoints every --checkpoint_every.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from app import recipes
from app.allreduce.world import PeerLost, World, reason
from app.checkpoint.files import cpu_copy
from app.checkpoint.writer import Checkpointer
from app.config import Config
from app.runtime import devices, lifecycle, words
from app.runtime.logs import progress
from app.training import loop, losses, optimizers
from app.training.evaluate import evaluate, fields, line
from app.training.metrics import MetricsWriter, Rates


@dataclass(frozen=True)
class Progress:
    """Where the job is: optimizer steps, the last batch done of `epoch`, samples of all ranks."""

    step: int = 0
    epoch: int = 1
    batch: int = 0
    samples: int = 0


class EpochSampler(DistributedSampler):
    """DistributedSampler (padded: every rank gets as many samples, so every rank takes
    as many steps), which can also leave out an epoch's first `skip` indices: those a
    resumed job trained on before it stopped."""

    def __init__(self, dataset: Dataset, world: World, seed: int) -> None:
        super().__init__(dataset, num_replicas=world.size, rank=world.rank, shuffle=True, seed=seed)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.skip, None)


class JobState:
    """The model, optimizer and progress in the shape a Checkpointer saves and restores
    (`version`, `checkpoint()`, `restore()`); tensors are written on CPU."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer
        self.progress = Progress()
        self.finished = False

    @property
    def version(self) -> int:
        return self.progress.step

    def checkpoint(self) -> dict[str, Any]:
        return {
            "version": self.progress.step,
            "model": cpu_copy(self.module.state_dict()),
            "optimizer": cpu_copy(self.optimizer.state_dict()),
            # Not per rank (the PS's shape): every rank of a DDP job is at the same place.
            "progress": dataclasses.asdict(self.progress),
            "finished": self.finished,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.progress = Progress(**state["progress"])


def planned_steps(loader: DataLoader, epochs: int, max_steps: int) -> int:
    """The steps an allreduce job plans (its schedule spans them): every rank's batches of every
    epoch, at most --max_steps; 0 for a loader without a length."""
    try:
        total = len(loader) * epochs
    except TypeError:
        return 0
    return min(total, max_steps) if max_steps else total


class AllreduceTrainer:
    """The loop of one rank; rank 0 also evaluates and checkpoints (`rank0` is not None)."""

    def __init__(
        self,
        config: Config,
        world: World,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        state: JobState,
        loader: DataLoader,
        sampler: EpochSampler,
        device: torch.device,
        metrics: MetricsWriter,
        rank0: Optional[tuple[Checkpointer, DataLoader]],
    ) -> None:
        self.config, self.world, self.model, self.optimizer = config, world, model, optimizer
        self.state, self.loader, self.sampler, self.device = state, loader, sampler, device
        self.metrics, self.rank0 = metrics, rank0
        self.loss_fn = losses.build(config.loss)
        self.losses = loop.Losses(device)  # a step's loss read a step later: no host wait
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.total = planned_steps(loader, config.epochs, config.max_steps)
        self.format = devices.memory_format(config, device)
        self.scaler = torch.amp.GradScaler("cuda") if config.precision == "fp16" else None  # CUDA only
        self.evaluation: threading.Thread | None = None  # rank 0: the periodic evaluation running
        self.reporter = loop.Reporter(config.name, config.log_every, metrics)
        self.rates = Rates(state.progress.step, state.progress.samples)  # rank 0: the pace between evaluations

    def train(self) -> None:
        """From `state.progress` to the last epoch (or --max_steps)."""
        self.model.train()
        start = self.state.progress
        for epoch, batch, x, y in loop.resume_batches(
            self.loader,
            self.sampler,
            self.config.data_dir,
            start.epoch,
            start.batch,
            self.config.epochs,
            self.config.batch_size,
        ):
            loss = self.step(x, y, epoch, batch)
            self.reporter.batch_done(self.loader, self.state.progress.step, epoch, batch, len(y), loss)
            self.rank0_duties()
            if 0 < self.config.max_steps <= self.state.progress.step:
                break
        self.reporter.flush()

    def step(self, x: torch.Tensor, y: torch.Tensor, epoch: int = 1, batch: int = 0) -> loop.Loss:
        """Forward, backward (DDP allreduces the gradients meanwhile), the gradient clipped
        (train.clip_grad_norm), one optimizer step at the schedule's rate for this step, and
        the progress that labels it: a SIGTERM lands before both or after both. The loss as
        the host will read it, without waiting for the GPU."""
        x, y = loop.on_device(x, y, self.loader, self.device, self.format)
        self.optimizer.zero_grad(set_to_none=True)
        self.set_rate()
        with devices.autocast(self.config.precision, self.device):
            loss = self.loss_fn(self.model(x), y)
        try:
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        except RuntimeError as error:  # gloo/NCCL: a peer died or timed out
            raise self.lost(error) from error
        if self.config.clip_grad_norm:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad_norm)
        with lifecycle.sigterm_deferred():
            if self.scaler is None:
                self.optimizer.step()
            else:  # skips the step when the gradient overflowed (every rank alike: it is averaged)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            p = self.state.progress
            self.state.progress = Progress(p.step + 1, epoch, batch, p.samples + len(y) * self.world.size)
        return self.losses.take(loss)

    def set_rate(self) -> None:
        """The schedule's rate for the next step (app/recipes.py lr_factor): by the job's steps."""
        schedule = self.config.schedule
        if schedule["name"] == "constant" and not schedule.get("warmup"):
            return
        factor = recipes.lr_factor(schedule, self.state.progress.step, self.total, self.base_lrs[0])
        optimizers.set_rates(self.optimizer, self.base_lrs, factor)

    def lost(self, error: BaseException) -> PeerLost:
        return PeerLost(
            f"lost a peer of the allreduce job ({words.counted(self.world.size, 'worker')}, rendezvous "
            f"{self.world.addr}:{self.world.port}) at step {self.state.progress.step + 1}: "
            f"{reason(error)}"
        )

    def rank0_duties(self) -> None:
        if self.rank0 is None:
            return
        checkpoints, held_out = self.rank0
        step = self.state.progress.step
        if step % self.config.eval_every == 0 and not self.evaluating():
            model = copy.deepcopy(self.model.module)  # this step's weights; training goes on
            at = self.state.progress
            pace = self.rates.since(at.step, at.samples)
            self.evaluation = threading.Thread(
                target=self._evaluate, args=(model, held_out, at, pace), name="evaluation", daemon=True
            )
            self.evaluation.start()
        if checkpoints.due():
            checkpoints.save(f"every {words.counted(self.config.checkpoint_every, 'step')}")

    def evaluating(self) -> bool:
        """A periodic evaluation still runs (the next one is skipped, not queued)."""
        return self.evaluation is not None and self.evaluation.is_alive()

    def wait_for_evaluation(self) -> None:
        if self.evaluation is not None:
            self.evaluation.join()

    def _evaluate(self, model: nn.Module, held_out: DataLoader, at: Progress, pace: dict[str, float]) -> None:
        scores = evaluate(model, held_out, self.device, self.config.metrics, self.loss_fn)
        progress.info("%s | Step: %d | %s", self.config.name, at.step, line(scores))
        self.metrics.write(
            "eval",
            at.step,
            **fields(scores),
            lr=self.optimizer.param_groups[0]["lr"],
            samples=at.samples,
            workers=self.world.size,
            **pace,
        )
