"""The worker process: check input, join (or rejoin) the job, train, report, leave.

SIGTERM while it trains (a scale down, or the cluster stopping) is a clean leave:
the push on the wire is answered, the PS records the rank as `left` and stops
waiting for it, and the process exits 0."""

from __future__ import annotations

import logging
import signal
import time

from app import runtime
from app.common import data, models
from app.common.metrics import MetricsWriter
from app.config import Config
from app.ps import membership
from app.runtime import choose_device, gpu_identity, rpc_session
from app.worker.client import PSClient, PSUnreachable
from app.worker.sharded_client import ShardedClient, wait_until_ready
from app.worker.trainer import Trainer

log = logging.getLogger("app.worker")


def run(config: Config) -> int:
    """Check input, join (or rejoin) the job, train, report, leave."""
    device = choose_device(config.device)
    runtime.tune_for(device)
    models.check(config.model)
    workers, why = data.loader_choice(config)
    # A rank above the first ones (the job was scaled up) starts from a share among as many;
    # each epoch's share then comes from the PS (Trainer.reshard).
    shards = max(config.num_trainers, config.rank)
    train = data.load_for(config, "train", workers, shard=(config.rank - 1, shards))
    data.log_loader(config.name, workers, why)
    sampler = data.shard_sampler(train, shards, config.rank - 1, config.seed)
    loader = data.train_loader(train.data, sampler, config.batch_size, workers, pin_memory=device.type == "cuda")
    log.info("%s: shard of %d samples (%s)", config.name, len(sampler), data.describe(train))
    model = models.build(config.model, train.channels, train.num_classes, config.seed).to(device)
    name, rpc_id = membership.claim_identity(config.rank, config.master_addr, config.master_port, config.rpc_timeout)
    # Under ssp and sync a push waits for the slowest worker, which may be a rank the
    # PS waits join_timeout for.
    push_wait = config.join_timeout if config.strategy in ("ssp", "sync") else 0.0
    client: PSClient | ShardedClient = PSClient(
        config.rank,
        config.rpc_timeout,
        f"{config.master_addr}:{config.master_port}",
        name,
        push_wait,
        exchange=config.exchange,
        device=device,
    )
    if config.shards > 1:  # join the RPC group once every PS shard is in it (app.ps.sharding.slices)
        wait_until_ready(config.master_addr, config.master_port, config.join_timeout)
        client = ShardedClient(client, chained=config.staleness_lr)
        client.num_params = sum(p.numel() for p in model.parameters())
    with MetricsWriter(config.metrics_dir, config.name, "worker", config.rank) as metrics:
        started = time.monotonic()
        with rpc_session(config, rank=rpc_id, name=name):
            start = client.join()
            metrics.start(config, start["pushes"])
            metrics.write(
                "join", start["pushes"], worker=name, epoch=start["epoch"], batch=start["batch"], **gpu_identity(device)
            )
            trainer = Trainer(config, model, loader, sampler, device, client, metrics)
            try:
                pushes = trainer.train(start)
            except SystemExit:  # SIGTERM: scaled down (or the cluster stops): leave the job cleanly
                return leave(trainer, client, metrics, started)
            client.finish(pushes)
            metrics.write(
                "end",
                pushes,
                seconds=round(time.monotonic() - started, 2),
                refused=trainer.refused,
                skipped=trainer.skipped,
                **data.skipped(train.data),
            )
    return 0


def leave(trainer: Trainer, client: PSClient | ShardedClient, metrics: MetricsWriter, started: float) -> int:
    """After SIGTERM: take the answer to a push still on the wire, tell the PS this rank leaves
    (it stops waiting for it: a `left` record, not a drop) and exit 0, so compose's restart
    policy (on-failure) leaves it stopped. When the PS is gone too, 143 as any SIGTERM."""
    try:
        pushes = trainer.last_reply()
        client.leave(pushes)
    except PSUnreachable as error:  # the PS stops too (the whole cluster stops): nothing to tell it
        log.info("%s stopped (SIGTERM) without leaving: %s", client.name, error)
        return 128 + signal.SIGTERM
    log.info("%s left the job after %d pushes (SIGTERM)", client.name, pushes)
    metrics.write("left", pushes, worker=client.name, seconds=round(time.monotonic() - started, 2))
    return 0
