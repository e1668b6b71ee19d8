"""The worker process: check input, join (or rejoin) the job, train, report, leave.

SIGTERM (a scale down, or the cluster stopping) ends it with status 0 and one line at any
moment of its life. Before it asks the PS to join, it exits at once: nothing to hand over
(app.__main__ sets that up), but it tells the PS first, as when the user's code exits 0 before
the join, so that the PS does not wait --join_timeout for the rank. From its join on, the PS
has the rank: the join's answer is taken, the push on the wire is answered, the PS records the
rank as `left` and stops waiting for it. Once it trained its epochs, its finish and `end`
record are made whole first."""

from __future__ import annotations

import functools
import logging
import signal
import time
from contextlib import ExitStack

import torch
from torch import nn
from torch.utils.data import DataLoader

from app.config import Config, UsageError
from app.contract import PS, strategy_of
from app.data import datasets
from app.data.datasets import LabeledData, ShardSampler
from app.data.streams import StreamSampler
from app.exchange import group, transport
from app.exchange.route import PSUnreachable
from app.exchange.wire import Start
from app.runtime import devices, lifecycle, words
from app.runtime.devices import choose_device, gpu_identity
from app.training import models
from app.training.metrics import MetricsWriter, run_records
from app.worker.channels import Channel, PSChannel, wait_until_ready
from app.worker.trainer import Trainer

log = logging.getLogger("app.worker")
Sampler = ShardSampler | StreamSampler  # a worker's share of each epoch: of an indexed split, or of a stream


def run(config: Config) -> int:
    """Check input, join (or rejoin) the job, train, report, leave. 0 at once, with one line,
    when the run has ended already (a worker scaled up just before the end, or restarted
    after it), and 0 after a failure to reach the PS that the PS's end explains."""
    device = choose_device(config.device)
    devices.tune_for(device)
    models.check(config.model)
    if run_ended(config):
        return 0
    try:
        train, loader, sampler, model = prepare(config, device)
    except SystemExit as end:  # the user's code (a model or dataset factory) ended the process
        if end.code in (None, 0):  # cleanly: its PS is told not to wait for the rank
            group.say_not_joining(config)
        raise
    try:
        # a worker (re)started before its PS waits for it (--join_timeout), and exits 0 with one
        # line when the PS's records say the run ended meanwhile
        ended = functools.partial(run_ended, config)
        if not group.wait_for_ps(config, config.join_timeout, ended, config.name):
            return 0
        return join_and_train(config, device, model, train, loader, sampler)
    except UsageError:
        raise
    except Exception:  # the PS is gone: it may have ended the run meanwhile (its records say)
        if run_ended(config):
            return 0
        raise


def prepare(config: Config, device: torch.device) -> tuple[LabeledData, DataLoader, Sampler, nn.Module]:
    """The worker's shard of the training data, its loader and sampler, and the model on `device`."""
    workers, why = datasets.loader_choice(config)
    # A rank above the first ones (the job was scaled up) starts from a share among as many;
    # each epoch's share then comes from the PS (Trainer.reshard).
    shards = max(config.num_trainers, config.rank)
    train = datasets.load_for(config, "train", workers, shard=(config.rank - 1, shards))
    datasets.log_loader(config.name, workers, why)
    sampler = datasets.shard_sampler(train, shards, config.rank - 1, config.seed, config.batch_size)
    loader = datasets.train_loader(train.data, sampler, config.batch_size, workers, pin_memory=device.type == "cuda")
    log.info("%s: %s (%s)", config.name, datasets.share_size(sampler), datasets.describe(train))
    model = models.build(config.model, train.channels, train.num_classes, config.seed).to(device)
    return train, loader, sampler, model


def run_ended(config: Config) -> bool:
    """True, with one line, when the PS's records of this run (on the state volume: the
    metrics dir) hold its `end`, or final.pt's `checkpoint` record: nothing left to train.
    False without a run id (runs cannot be told apart)."""
    records = run_records(config.metrics_dir, PS, config.run_id)
    ended = next((r for r in reversed(records) if r.get("event") == "end" or r.get("file") == "final.pt"), None)
    if ended is None:
        return False
    log.info(
        "%s: run %s already ended at version %s (the PS's records in %s); nothing to do",
        config.name,
        config.run_id,
        ended.get("step"),
        config.metrics_dir,
    )
    return True


def join_and_train(
    config: Config,
    device: torch.device,
    model: nn.Module,
    train: LabeledData,
    loader: DataLoader,
    sampler: Sampler,
) -> int:
    """Join the job as a new process of config.rank, train to the last epoch, tell the PS."""
    name, rpc_id = group.claim_identity(config)
    # Under ssp and sync a push waits for the slowest worker, which may be a rank the
    # PS waits join_timeout for.
    push_wait = config.join_timeout if strategy_of(config.strategy).waits else 0.0
    channel = PSChannel(
        config.rank,
        config.rpc_timeout,
        group.where(config),
        name,
        push_wait,
        exchange=config.exchange,
        device=device,
        sharded=config.shards > 1,
        chained=config.staleness_lr,
        overlap=config.overlap,
    )
    group.check_shape(config, train.channels, train.num_classes, config.rpc_timeout)
    problem = datasets.plan_problem(train, config.max_steps, config.strategy)
    if problem is not None:  # every worker would meet it: the PS stops on it too
        group.say_mistake(config, problem, config.rpc_timeout)
    if config.shards > 1:  # join the RPC group once every PS shard is in it (app.ps.sharding.slices)
        wait_until_ready(config, config.join_timeout)
    with MetricsWriter(config.metrics_dir, config.name, "worker", config.rank) as metrics, ExitStack() as session:
        started = time.monotonic()
        start: Start | None = None
        trainer: Trainer | None = None
        try:
            # In the RPC group, the process is on its member list until the PS takes it off as it
            # joins (app.exchange.group): a SIGTERM from here on joins first, then leaves.
            with lifecycle.sigterm_deferred():
                lifecycle.sigterm_exits_at_once("")
                session.enter_context(transport.session(config, rank=rpc_id, name=name))
                start = channel.join()
            at = start.progress
            metrics.start(config, at.pushes)
            metrics.write("join", at.pushes, worker=name, epoch=at.epoch, batch=at.batch, **gpu_identity(device))
            trainer = Trainer(config, model, loader, sampler, device, channel, metrics)
            pushes = trainer.train(start)
        except SystemExit:
            if not lifecycle.sigterm_received():  # the user's code ended the process: its status stands
                raise
            return leave(start, trainer, channel, metrics, started)  # scaled down (or the cluster stops)
        try:
            with lifecycle.sigterm_deferred():  # its finish and `end` record whole
                channel.finish(pushes)
                metrics.write(
                    "end",
                    pushes,
                    seconds=round(time.monotonic() - started, 2),
                    refused=trainer.refused,
                    skipped=trainer.skipped,
                    **datasets.skipped(train.data),
                )
        except SystemExit:
            if not lifecycle.sigterm_received():
                raise
            done = words.counted(pushes, "push", "pushes")
            log.info("%s finished its epochs after %s; stopped (SIGTERM) as it ended", name, done)
    return 0


def leave(
    start: Start | None, trainer: Trainer | None, channel: Channel, metrics: MetricsWriter, started: float
) -> int:
    """After SIGTERM: take the answer to a push still on the wire, tell the PS this rank leaves
    (it stops waiting for it: a `left` record, not a drop) and exit 0, so compose's restart
    policy (on-failure) leaves it stopped. When the PS is gone too, 143 as any SIGTERM."""
    if start is None:  # its join failed as the SIGTERM came: the PS does not have it
        log.info("%s stopped (SIGTERM) while joining the job", channel.name)
        return 0
    try:
        pushes = max(trainer.last_reply() if trainer is not None else 0, start.progress.pushes)
        channel.leave(pushes)
    except PSUnreachable as error:  # the PS stops too (the whole cluster stops): nothing to tell it
        log.info("%s stopped (SIGTERM) without leaving: %s", channel.name, error)
        return 128 + signal.SIGTERM
    log.info("%s left the job after %s (SIGTERM)", channel.name, words.counted(pushes, "push", "pushes"))
    metrics.write("left", pushes, worker=channel.name, seconds=round(time.monotonic() - started, 2))
    return 0
