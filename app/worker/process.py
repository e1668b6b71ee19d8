"""The worker process: check input, join (or rejoin) the job, train, report, leave."""

from __future__ import annotations

import logging
import time

from app import runtime
from app.common import data, models
from app.common.metrics import MetricsWriter
from app.config import Config
from app.ps import membership
from app.runtime import choose_device, gpu_identity, rpc_session
from app.worker.client import PSClient
from app.worker.sharded_client import ShardedClient, wait_until_ready
from app.worker.trainer import Trainer

log = logging.getLogger("app.worker")


def run(config: Config) -> int:
    """Check input, join (or rejoin) the job, train, report, leave."""
    device = choose_device(config.device)
    runtime.tune_for(device)
    models.check(config.model)
    workers, why = data.loader_choice(config)
    train = data.load_for(config, "train", workers, shard=(config.rank - 1, config.num_trainers))
    data.log_loader(config.name, workers, why)
    sampler = data.shard_sampler(train, config.num_trainers, config.rank - 1, config.seed)
    loader = data.train_loader(train.data, sampler, config.batch_size, workers, pin_memory=device.type == "cuda")
    log.info("%s: shard of %d samples (%s)", config.name, len(sampler), data.describe(train))
    model = models.build(config.model, train.channels, train.num_classes, config.seed).to(device)
    name, rpc_id = membership.claim_identity(config.rank, config.master_addr, config.master_port, config.rpc_timeout)
    # Under ssp and sync a push waits for the slowest worker, which may be a rank the
    # PS waits join_timeout for.
    push_wait = config.join_timeout if config.strategy in ("ssp", "sync") else 0.0
    client: PSClient | ShardedClient = PSClient(
        config.rank, config.rpc_timeout, f"{config.master_addr}:{config.master_port}", name, push_wait
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
            pushes = trainer.train(start)
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
