"""`--strategy allreduce`: the workers train one model with DistributedDataParallel; no PS.

The usual DDP job: a DistributedSampler with `set_epoch`, gradients averaged by
DDP's allreduce, rank-0 checkpoints, Gloo on CPU and NCCL on GPU. Its parts: the
world and its rendezvous (app.allreduce.world), one rank's loop
(app.allreduce.trainer), --compress's hooks (app.allreduce.hooks); this module runs
a rank from its start to its exit:

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

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from app import plugins, recipes
from app.allreduce.hooks import compress_hook
from app.allreduce.trainer import AllreduceTrainer, EpochSampler, JobState, Progress
from app.allreduce.world import World, leave_together, rendezvous, world_of
from app.checkpoint.files import cpu_copy
from app.checkpoint.writer import Checkpointer
from app.config import Config, UsageError
from app.data import datasets
from app.runtime import devices, lifecycle, machine, words
from app.runtime.devices import choose_device
from app.runtime.logs import progress
from app.training import losses, models, optimizers
from app.training.evaluate import evaluate, fields, line
from app.training.metrics import MetricsWriter

log = logging.getLogger("app.allreduce")


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
    machine.set_threads(world.size)
    inputs = load_inputs(config, world, device)
    state = build_state(config, inputs.train, device)

    with MetricsWriter(config.metrics_dir, config.name, "worker", config.rank) as metrics:
        checkpoints = rank0_checkpointer(config, world, inputs.train, state, metrics)
        backend = join_job(config, world, device, state, checkpoints)
        p = state.progress
        metrics.start(config, p.step)
        metrics.write("join", p.step, worker=config.name, epoch=p.epoch, batch=p.batch, **devices.gpu_identity(device))
        model = DistributedDataParallel(state.module, device_ids=[device.index] if device.type == "cuda" else None)
        if config.compress != "none":
            model.register_comm_hook(None, compress_hook(config.compress, backend))
        rank0 = None
        if checkpoints is not None and inputs.held_out is not None:
            held_out = datasets.eval_loader(inputs.held_out.data, config.held_out_batch, inputs.loader_workers)
            rank0 = (checkpoints, held_out)
        trainer = AllreduceTrainer(
            config, world, model, state.optimizer, state, inputs.loader, inputs.sampler, device, metrics, rank0
        )
        seconds = train_timed(trainer, checkpoints)
        trainer.wait_for_evaluation()
        leave_together(world)
        if rank0 is None:
            metrics.write("end", state.progress.step, seconds=round(seconds, 2), **datasets.skipped(inputs.train.data))
        else:
            finish_rank0(config, state, *rank0, device, metrics, seconds)
    # Leave without tearing torch down: destroying DDP's Gloo process group can
    # deadlock (seen in containers, torch 2.13: the main thread, holding the GIL,
    # joins Gloo's run-loop thread, which needs the GIL to free its last work).
    # Everything is written; the job ended for every rank (leave_together).
    lifecycle.exit_now(0)
    return 0


def rank_device(config: Config, world: World) -> torch.device:
    """--device, tuned; under torchrun with several GPUs a node, the GPU of LOCAL_RANK."""
    device = choose_device(config.device)
    devices.tune_for(device)
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
    problem = datasets.plan_problem(train, config.max_steps, config.strategy)
    if problem is not None:
        raise UsageError(problem)
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
    """The model (--init_weights on every rank, so none starts from other weights than rank 0's) and its
    optimizer (train.optimizer, as the PS builds it: app.training.optimizers)."""
    module = models.build(config.model, train.channels, train.num_classes, config.seed)
    if config.init_weights:
        plugins.load_weights(module, config.init_weights)
    module = module.to(device)
    module = module.to(memory_format=devices.memory_format(config, device))
    recipe = recipes.resolve_optimizer(config.optimizer, config.lr, config.momentum, config.weight_decay)
    return JobState(module, optimizers.make(recipe, optimizers.model_groups(module, recipe)))


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
        "%s joined the allreduce job at %s (%s, %s)",
        config.name,
        world.where(),
        words.counted(world.size, "worker"),
        backend,
    )
    finished = start_state(state, checkpoints, device)
    if finished:
        log.info("%s", finished)
        lifecycle.exit_now(0)
    return backend


def train_timed(trainer: AllreduceTrainer, checkpoints: Optional[Checkpointer]) -> float:
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
    config: Config,
    state: JobState,
    checkpoints: Checkpointer,
    held_out: DataLoader,
    device: torch.device,
    metrics: MetricsWriter,
    seconds: float,
) -> None:
    """The last checkpoint (finished) and final.pt; the held-out metrics, printed as the PS does."""
    state.finished = True
    checkpoints.final()
    scores = evaluate(state.module, held_out, device, config.metrics, losses.build(config.loss))
    progress.info("%s", line(scores))
    progress.info("Time: %.2f seconds", seconds)
    p = state.progress
    if p.step % config.eval_every:  # not evaluated at this step yet
        metrics.write("eval", p.step, **fields(scores), samples=p.samples)
    metrics.write("end", p.step, **fields(scores), seconds=round(seconds, 2), samples=p.samples)


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
