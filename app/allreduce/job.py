"""`--strategy allreduce`: the workers train one model with DistributedDataParallel; no PS.

The usual DDP job: a DistributedSampler with `set_epoch`, gradients averaged by
DDP's allreduce, rank-0 checkpoints, Gloo on CPU and NCCL on GPU. The world is
the workers alone: DDP rank = --rank - 1 and world size = --world_size - 1 (the
config counts a PS slot), rendezvous at --master_addr:--master_port (worker1's
service in compose). Under torchrun, its RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT (and LOCAL_RANK) win.

    rendezvous (init_process_group, bounded by --rpc_timeout)
    rank 0 resumes from its newest good checkpoint; DDP broadcasts rank 0's
        parameters, rank 0 broadcasts the optimizer state and the progress
    each epoch: set_epoch; forward, backward (DDP averages the gradients), SGD step;
        rank 0 evaluates every --eval_every steps (in a background thread, on a copy of
        the weights, so the others never wait for it in their next allreduce),
        checkpoints every --checkpoint_every
    rank 0: the last checkpoint, final.pt, `Accuracy:` and `Time:`

A peer that dies fails the step's allreduce on every other rank: one error line,
exit 1. Compose restarts the containers (`restart: on-failure`) and the job
resumes from rank 0's newest checkpoint (written on the way out, too).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from app import plugins, runtime
from app.checkpoint.files import cpu_copy
from app.checkpoint.writer import Checkpointer
from app.config import Config, UsageError
from app.data import datasets
from app.runtime import choose_device, progress
from app.training import loop, models
from app.training.evaluate import held_out_accuracy
from app.training.metrics import MetricsWriter, Rates

log = logging.getLogger("app.allreduce.job")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class PeerLost(RuntimeError):
    """A collective failed: another rank died, or did not answer within --rpc_timeout."""


@dataclass(frozen=True)
class World:
    """This process's place in the DDP job."""

    rank: int  # 0..size-1; rank 0 is worker1
    size: int  # the number of workers
    addr: str
    port: int
    local_rank: int  # torchrun's LOCAL_RANK: the GPU of this process on a multi-GPU node
    torchrun: bool  # the rendezvous comes from torchrun's environment (init_method env://)


def world_of(config: Config, env: Mapping[str, str]) -> World:
    """torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT when all are set, else the config's."""
    if all(env.get(k) for k in TORCHRUN_ENV):
        try:
            rank, size, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
            local_rank = int(env.get("LOCAL_RANK") or 0)
        except ValueError:
            raise UsageError(
                "torchrun's RANK, WORLD_SIZE, MASTER_PORT and LOCAL_RANK must be whole numbers, "
                f"got {', '.join(f'{k}={env.get(k)!r}' for k in (*TORCHRUN_ENV, 'LOCAL_RANK'))}"
            ) from None
        if not 0 <= rank < size:
            raise UsageError(f"RANK {rank} must be in 0..{size - 1} (WORLD_SIZE {size})")
        return World(rank, size, env["MASTER_ADDR"], port, local_rank, True)
    return World(config.rank - 1, config.num_trainers, config.master_addr, config.master_port, 0, False)


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


class Trainer:
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
        self.loss_fn = nn.CrossEntropyLoss()
        self.format = runtime.memory_format(config, device)
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
            self.config.num_epochs,
            self.config.batch_size,
        ):
            loss = self.step(x, y, epoch, batch)
            self.reporter.batch_done(self.loader, self.state.progress.step, epoch, batch, len(y), loss)
            self.rank0_duties()
            if 0 < self.config.max_steps <= self.state.progress.step:
                return

    def step(self, x: torch.Tensor, y: torch.Tensor, epoch: int = 1, batch: int = 0) -> float:
        """Forward, backward (DDP allreduces the gradients meanwhile), one SGD step, and
        the progress that labels it: a SIGTERM lands before both or after both."""
        x, y = loop.on_device(x, y, self.loader, self.device, self.format)
        self.optimizer.zero_grad(set_to_none=True)
        with runtime.autocast(self.config.precision, self.device):
            loss = self.loss_fn(self.model(x), y)
        try:
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        except RuntimeError as error:  # gloo/NCCL: a peer died or timed out
            raise self.lost(error) from error
        with runtime.sigterm_deferred():
            if self.scaler is None:
                self.optimizer.step()
            else:  # skips the step when the gradient overflowed (every rank alike: it is averaged)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            p = self.state.progress
            self.state.progress = Progress(p.step + 1, epoch, batch, p.samples + len(y) * self.world.size)
        return loss.item()

    def lost(self, error: BaseException) -> PeerLost:
        return PeerLost(
            f"lost a peer of the allreduce job ({self.world.size} workers, rendezvous "
            f"{self.world.addr}:{self.world.port}) at step {self.state.progress.step + 1}: "
            f"{_reason(error)}"
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
            checkpoints.save(f"every {self.config.checkpoint_every} steps")

    def evaluating(self) -> bool:
        """A periodic evaluation still runs (the next one is skipped, not queued)."""
        return self.evaluation is not None and self.evaluation.is_alive()

    def wait_for_evaluation(self) -> None:
        if self.evaluation is not None:
            self.evaluation.join()

    def _evaluate(self, model: nn.Module, held_out: DataLoader, at: Progress, pace: dict[str, float]) -> None:
        accuracy, loss = held_out_accuracy(model, held_out, self.device)
        progress.info("%s | Step: %d | Accuracy: %.4f", self.config.name, at.step, accuracy)
        self.metrics.write(
            "eval",
            at.step,
            accuracy=round(accuracy, 4),
            loss=round(loss, 4),
            samples=at.samples,
            workers=self.world.size,
            **pace,
        )


def _reason(error: BaseException) -> str:
    """The gist of a gloo/NCCL error: its first sentence, without the source location."""
    return re.sub(r"^\[[^\]]*\]\s*", "", runtime.first_line(error)).split(". ")[0]


def rendezvous(world: World, device: torch.device, timeout: float) -> str:
    """Join the process group (every rank waits for all); the backend's name."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    runtime.set_gloo_interface(world.addr)
    init = "env://" if world.torchrun else f"tcp://{world.addr}:{world.port}"
    where = f"{world.addr}:{world.port}"
    with runtime.deadline(timeout + 10, f"rank {world.rank}: the rendezvous at {where}"):
        try:
            dist.init_process_group(
                backend, init_method=init, rank=world.rank, world_size=world.size, timeout=timedelta(seconds=timeout)
            )
        except (RuntimeError, ValueError) as error:  # DistStoreError, DistNetworkError...
            raise PeerLost(
                f"the rendezvous of {world.size} workers at {where} failed "
                f"within --rpc_timeout {timeout:.0f} s: {_reason(error)}"
            ) from error
    return backend


def start_state(state: JobState, checkpoints: Optional[Checkpointer], device: torch.device) -> str:
    """Rank 0 resumes from its checkpoint, then tells every rank where the job is and
    the optimizer's state (DDP itself broadcasts rank 0's parameters and buffers).
    Returns, on every rank, why there is nothing to do ('' when there is): this run
    already finished (a restart after its end)."""
    if checkpoints is not None:
        checkpoints.resume()
    box: list[Any] = [None]
    if checkpoints is not None:
        box = [
            {
                "progress": dataclasses.asdict(state.progress),
                "optimizer": cpu_copy(state.optimizer.state_dict()),
                "finished": checkpoints.run_finished,
            }
        ]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    if checkpoints is None:
        state.progress = Progress(**box[0]["progress"])
        state.optimizer.load_state_dict(box[0]["optimizer"])
    return box[0]["finished"]


def compress_hook(name: str, backend: str) -> Any:
    """DDP's fp16_compress_hook / bf16_compress_hook (registered with state None). torch's
    bf16 hook refuses anything but NCCL, though Gloo reduces bfloat16: on Gloo, the same
    hook written out (`bf16_gloo_hook`)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if name == "fp16":
        return default_hooks.fp16_compress_hook
    return default_hooks.bf16_compress_hook if backend == "nccl" else bf16_gloo_hook


def bf16_gloo_hook(process_group, bucket):
    """What bf16_compress_hook does: the bucket cast to bfloat16, divided by the world size,
    allreduced, cast back into the bucket. (No annotations: register_comm_hook compares them
    with the real classes, and this module's are strings.)"""
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None, "DDP calls its hooks in a joined process group"
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut):
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def run(config: Config, env: Optional[Mapping[str, str]] = None) -> int:
    """One rank of the DDP job: check input, rendezvous, (resume,) train, report, leave.
    Raises on bad input or a failure; at the end the process exits 0 (see below)."""
    world = world_of(config, os.environ if env is None else env)
    # The rest of the app knows a worker by rank 1..N and a world with a PS slot.
    config = dataclasses.replace(
        config, rank=world.rank + 1, world_size=world.size + 1, master_addr=world.addr, master_port=world.port
    )
    device = rank_device(config, world)
    models.check(config.model)
    runtime.set_threads(world.size)
    inputs = load_inputs(config, world, device)
    state = build_state(config, inputs.train, device)

    with MetricsWriter(config.metrics_dir, config.name, "worker", config.rank) as metrics:
        checkpoints = rank0_checkpointer(config, world, inputs.train, state, metrics)
        backend = join_job(config, world, device, state, checkpoints)
        p = state.progress
        metrics.start(config, p.step)
        metrics.write("join", p.step, worker=config.name, epoch=p.epoch, batch=p.batch, **runtime.gpu_identity(device))
        model = DistributedDataParallel(state.module, device_ids=[device.index] if device.type == "cuda" else None)
        if config.compress != "none":
            model.register_comm_hook(None, compress_hook(config.compress, backend))
        rank0 = None
        if checkpoints is not None and inputs.held_out is not None:
            rank0 = (checkpoints, datasets.eval_loader(inputs.held_out.data, config.batch_size, inputs.loader_workers))
        trainer = Trainer(
            config, world, model, state.optimizer, state, inputs.loader, inputs.sampler, device, metrics, rank0
        )
        seconds = train_timed(trainer, checkpoints)
        trainer.wait_for_evaluation()
        leave_together(world)
        if rank0 is None:
            metrics.write("end", state.progress.step, seconds=round(seconds, 2), **datasets.skipped(inputs.train.data))
        else:
            finish_rank0(state, *rank0, device, metrics, config.eval_every, seconds)
    # Leave without tearing torch down: destroying DDP's Gloo process group can
    # deadlock (seen in containers, torch 2.13: the main thread, holding the GIL,
    # joins Gloo's run-loop thread, which needs the GIL to free its last work).
    # Everything is written; the job ended for every rank (leave_together).
    runtime.exit_now(0)
    return 0


def rank_device(config: Config, world: World) -> torch.device:
    """--device, tuned; under torchrun with several GPUs a node, the GPU of LOCAL_RANK."""
    device = choose_device(config.device)
    runtime.tune_for(device)
    if device.type == "cuda" and world.local_rank < torch.cuda.device_count():
        device = torch.device(f"cuda:{world.local_rank}")  # torchrun, several GPUs per node
        torch.cuda.set_device(device)
    return device


@dataclass(frozen=True)
class Inputs:
    """A rank's train data, its sampler and loader; rank 0's held-out split (None elsewhere)."""

    train: datasets.LabeledData
    sampler: EpochSampler
    loader: DataLoader
    held_out: Optional[datasets.LabeledData]
    loader_workers: int


def load_inputs(config: Config, world: World, device: torch.device) -> Inputs:
    """The train split (this rank's shard when the image cache holds it), and on rank 0 the held-out one."""
    workers, why = datasets.loader_choice(config)
    # The image cache holds the rank's stable shard, padded: every rank takes as many steps.
    train = datasets.load_for(config, "train", workers, shard=(world.rank, world.size), pad=True)
    datasets.log_loader(config.name, workers, why)
    sampler = EpochSampler(
        train.data, dataclasses.replace(world, rank=0, size=1) if train.sharded else world, config.seed
    )
    loader = datasets.train_loader(train.data, sampler, config.batch_size, workers, pin_memory=device.type == "cuda")
    held_out = datasets.load_for(config, "test", workers) if world.rank == 0 else None
    log.info(
        "%s: rank %d of %d, %d samples a rank per epoch (%s)",
        config.name,
        world.rank,
        world.size,
        len(sampler),
        datasets.describe(train),
    )
    return Inputs(train, sampler, loader, held_out, workers)


def build_state(config: Config, train: datasets.LabeledData, device: torch.device) -> JobState:
    """The model (--init_weights on every rank, so none starts from other weights than rank 0's) and its SGD."""
    module = models.build(config.model, train.channels, train.num_classes, config.seed)
    if config.init_weights:
        plugins.load_weights(module, config.init_weights)
    module = module.to(device)
    module = module.to(memory_format=runtime.memory_format(config, device))
    optimizer = torch.optim.SGD(
        module.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    return JobState(module, optimizer)


def rank0_checkpointer(
    config: Config, world: World, train: datasets.LabeledData, state: JobState, metrics: MetricsWriter
) -> Optional[Checkpointer]:
    """Rank 0 checkpoints the job; the other ranks do not (None)."""
    if world.rank != 0:
        return None
    identity = dict(
        model_name=config.model,
        dataset=config.dataset,
        channels=train.channels,
        num_classes=train.num_classes,
        world_size=config.world_size,
        strategy="allreduce",
    )
    return Checkpointer(state, config, identity, metrics)


def join_job(
    config: Config, world: World, device: torch.device, state: JobState, checkpoints: Optional[Checkpointer]
) -> str:
    """Rendezvous, then where the job is (`start_state`); the process exits 0 here when the
    run already finished. The backend's name."""
    backend = rendezvous(world, device, config.rpc_timeout)
    log.info(
        "%s joined the allreduce job at %s:%d (%d workers, %s)",
        config.name,
        world.addr,
        world.port,
        world.size,
        backend,
    )
    finished = start_state(state, checkpoints, device)
    if finished:
        log.info("%s", finished)
        runtime.exit_now(0)
    return backend


def train_timed(trainer: Trainer, checkpoints: Optional[Checkpointer]) -> float:
    """`trainer.train()`; its seconds. On the way out with an error, rank 0 checkpoints first."""
    started = time.monotonic()
    try:
        trainer.train()
    except BaseException:  # a lost peer, SIGTERM: keep what was learned (the last whole step)
        if checkpoints is not None:
            checkpoints.save("on exit", on_exit=True)
        raise
    return time.monotonic() - started


def finish_rank0(
    state: JobState,
    checkpoints: Checkpointer,
    held_out: DataLoader,
    device: torch.device,
    metrics: MetricsWriter,
    eval_every: int,
    seconds: float,
) -> None:
    """The last checkpoint (finished) and final.pt; the held-out accuracy, printed as the PS does."""
    state.finished = True
    checkpoints.final()
    accuracy, loss = held_out_accuracy(state.module, held_out, device)
    progress.info("Accuracy: %.4f", accuracy)
    progress.info("Time: %.2f seconds", seconds)
    p = state.progress
    if p.step % eval_every:  # not evaluated at this step yet
        metrics.write("eval", p.step, accuracy=round(accuracy, 4), loss=round(loss, 4), samples=p.samples)
    metrics.write(
        "end", p.step, accuracy=round(accuracy, 4), loss=round(loss, 4), seconds=round(seconds, 2), samples=p.samples
    )


def leave_together(world: World) -> None:
    """A last barrier: every rank is past its last step before any of them exits
    (an exit while a peer still reads from it would fail that peer's step)."""
    try:
        dist.barrier()
    except RuntimeError as error:  # every step was done: the job's result stands
        log.warning(
            "rank %d: a peer left before the final barrier (%s); every step was done", world.rank, _reason(error)
        )
