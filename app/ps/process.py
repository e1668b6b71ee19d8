"""The PS process: resume, serve workers, evaluate, checkpoint, end.

    resume from the newest good checkpoint (or start fresh)
    join the job (rank 0 starts the RPC group)
    until every worker finished (or the missing ones are past --join_timeout):
        wait for pushes; ping quiet workers; evaluate every --eval_every updates;
        checkpoint every --checkpoint_every updates
    (each evaluation's line and `eval` record also say how far the run is: step of total,
    percent, samples/s and the ETA at the pace since the previous one, app.training.progress)
    save final.pt, print Accuracy, Time (training: from every worker joined to
    the last update applied) and Evaluation (the final evaluation's seconds)

On SIGTERM (or any failure) the PS checkpoints before it exits.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch
from torch import nn

from app import plugins
from app.checkpoint import export_files, mlflow_model
from app.checkpoint.writer import Checkpointer
from app.config import Config
from app.contract import PS, worker_name
from app.data import datasets
from app.exchange import group, transport
from app.ps.members.liveness import LivenessMonitor
from app.ps.rpc import Admit, Endpoint, Main
from app.ps.server import ParameterServer
from app.ps.sharding import shard_process
from app.ps.sharding.shardset import ShardSet
from app.ps.sharding.slices import bounds
from app.runtime.devices import choose_device
from app.runtime.logs import progress
from app.runtime.words import counted
from app.training import losses, models
from app.training.evaluate import Evaluator, MetricFailed, fields, headline, line
from app.training.flat import state_size
from app.training.metrics import MetricsWriter, Rates, run_records
from app.training.progress import RunProgress

log = logging.getLogger("app.ps")
TICK_SECONDS = 1.0


def run(config: Config) -> int:
    """The PS process; 0 when training ended, 1 when no worker ever finished."""
    if config.shard:
        return shard_process.run(config)
    device = choose_device(config.device)  # evaluation only; updates stay on CPU for RPC
    models.check(config.model)
    held_out, workers = _held_out(config)

    def build() -> nn.Module:
        return models.build(config.model, held_out.channels, held_out.num_classes, config.seed)

    loader = datasets.eval_loader(held_out.data, config.held_out_batch, workers)
    test, wrong = _test_split(config, held_out, workers)
    evaluate = Evaluator(build, loader, device, config.metrics, losses.build(config.loss), test=test)
    evaluate.preflight(config.model, config.loss["name"])  # a mistake in a plug-in stops the run here, once
    model = build()
    if config.init_weights:  # before the PS copies the model; a checkpoint to resume wins
        plugins.load_weights(model, config.init_weights)
    part = bounds(state_size(model), config.shards)[0] if config.shards > 1 else None
    # a finish is checkpointed before its worker hears back (checkpoints is set below, before
    # the PS joins the job: no worker can finish earlier)
    server = ParameterServer.from_config(config, model, part, PS, on_finish=lambda rank: checkpoints.finished(rank))
    log.info(
        "model %s: %d parameters, %d buffer values",
        config.model,
        server.state.flat.num_params,
        server.state.flat.num_buffers,
    )
    identity = _identity(config, held_out, part)
    if part is not None:
        log.info("shard 0 of %d: values %d..%d of %d", config.shards, *part, server.state.flat.size)
    with MetricsWriter(config.metrics_dir, PS, PS, 0) as metrics:
        others = (
            ShardSet(
                config.shards, server.state.flat.size, config, metrics.write, server.open_joins, server.close_joins
            )
            if part is not None
            else None
        )
        checkpoints = Checkpointer(server, config, identity, metrics, others.checkpoint if others else None)
        checkpoints.resume()
        ended = checkpoints.run_finished or workers_ended(config, server.version)
        if ended:  # a restart after the end, or of a run whose workers all ended: not a new run
            (log.info if checkpoints.run_finished else log.error)("%s", ended)
            return 0
        metrics.start(config, server.version)
        server.on_report = metrics.worker  # the workers' loss, as their pushes carry it, to MLflow
        shape = (held_out.channels, held_out.num_classes)
        trained = _serve(config, server, checkpoints, evaluate, metrics, others, shape, wrong)
        if trained is None:
            return 1
        _report_end(config, server, evaluate, metrics, held_out, *trained)
    return 0


def _held_out(config: Config) -> tuple[datasets.LabeledData, int]:
    """The held-out split the PS evaluates on, and the DataLoader processes it reads it with."""
    workers, why = datasets.loader_choice(config)
    held_out = datasets.load_for(config, "test", workers)
    datasets.log_loader(PS, workers, why)
    log.info("held-out split: %s", datasets.describe(held_out))
    return held_out, workers


def _test_split(
    config: Config, held_out: datasets.LabeledData, workers: int
) -> tuple[torch.utils.data.DataLoader | None, str]:
    """The loader of the dataset's test split, where it gives one; or (None, the one line of a
    test split that disagrees with the held-out split the model is built from)."""
    test = datasets.test_split(config)
    if test is None:
        return None, ""
    for what in ("num_classes", "channels"):
        if getattr(test, what) != getattr(held_out, what):
            return None, (
                f"--dataset {config.dataset}: the test split gives {what} {getattr(test, what)}; the held-out "
                f"split the PS built its model from gives {what} {getattr(held_out, what)}: every split must agree"
            )
    log.info("test split: %s, scored once at the end", datasets.describe(test))
    return datasets.eval_loader(test.data, config.held_out_batch, workers), ""


def _identity(config: Config, held_out: datasets.LabeledData, part: tuple[int, int] | None) -> dict[str, Any]:
    """What a checkpoint of this PS must match to be resumed. `trainer: ps` keeps a PS from
    resuming an allreduce job's checkpoint (app.allreduce.job)."""
    identity: dict[str, Any] = dict(
        model_name=config.model,
        dataset=config.dataset,
        channels=held_out.channels,
        num_classes=held_out.num_classes,
        world_size=config.world_size,
        trainer="ps",
    )
    if part is not None:
        identity.update(shards=config.shards, shard=0)
    return identity


def _serve(
    config: Config,
    server: ParameterServer,
    checkpoints: Checkpointer,
    evaluate: Evaluator,
    metrics: MetricsWriter,
    others: ShardSet | None,
    shape: tuple[int, int],
    wrong: str = "",
) -> tuple[torch.Tensor, int] | None:
    """Serve the job until it ends; final.pt written. The trained state and its version, or
    None when no worker finished its epochs."""
    liveness = LivenessMonitor(
        server,
        config.rpc_timeout,
        metrics.write,
        others.drop if others else None,
        config=config,
    )
    join: Admit = functools.partial(others.join, liveness.join) if others is not None else liveness.join

    def resumed() -> tuple[int, str] | None:  # the newest checkpoint, for a (re)starting shard
        return (checkpoints.saved_version, checkpoints.saved_run) if checkpoints.saved_version >= 0 else None

    if others is not None:  # workers can join once every shard is up (ShardSet's on_ready), not before
        server.close_joins()
    main = Main(others.register if others is not None else None, resumed)
    with Endpoint(server, join, main=main).serving(), transport.session(config, rank=0):
        store = transport.own_store(config, config.rpc_timeout)
        if wrong:  # a mistake of the job's the PS found at its start: the workers stop on it too
            group.say_ps_mistake(store, wrong)
        group.say_shape(store, *shape)  # what the workers check
        if others is None:
            server.open_joins()  # it listens: the workers' join_timeout counts from now
        try:
            train_until_done(server, liveness, checkpoints, evaluate, metrics, config, others)
        except BaseException:  # SIGTERM (SystemExit) or a failure: keep what was learned
            checkpoints.save("on exit", on_exit=True)
            raise
        if not server.all_finished:
            log.warning(
                "ending without %s: not back within --join_timeout %.0f s",
                ", ".join(f"rank {m.rank}" for m in server.members.roster.missing()),
                config.join_timeout,
            )
        if not server.members.finished:
            log.error("no worker finished its epochs; nothing to save as final")
            if others is not None:
                others.end(finished=False)
            return None
        if others is None:
            checkpoints.final()
            return server.snapshot()
        vector, version = _gather_final(server, others, config.rpc_timeout)
        checkpoints.final(evaluate.state_dict(vector))
        others.end(finished=server.all_finished)
        return vector, version


def _report_end(
    config: Config,
    server: ParameterServer,
    evaluate: Evaluator,
    metrics: MetricsWriter,
    held_out: datasets.LabeledData,
    vector: torch.Tensor,
    version: int,
) -> None:
    """The final evaluation: Accuracy, Time and Evaluation printed, the `end` record."""
    evaluated = time.monotonic()
    scores = _scores(evaluate, vector, version, set())  # None: said, and the end has no metrics
    eval_seconds = time.monotonic() - evaluated
    seconds = server.training_seconds() or 0.0
    if scores is not None:
        progress.info("%s", line(scores))
    tested = _tested(evaluate, vector)
    if tested is not None:
        progress.info("Test split: %s", line(tested))
    progress.info("Time: %.2f seconds", seconds)
    progress.info("Evaluation: %.2f seconds", eval_seconds)
    scored = fields(scores) if scores is not None else {}
    if metrics.tracker is not None:  # the model to MLflow: as MLflow loads it, and as `make export` writes it
        about = dict(run_id=config.run_id, version=version, finished=True, **export_files.scored(scored))
        trained = evaluate.state_dict(vector)
        logged = mlflow_model.of_run(config, trained, held_out)
        if logged:
            metrics.tracker.model(logged, "model")
        metrics.tracker.model(export_files.files(config, trained, held_out, **about), "export")
    metrics.write(
        "end",
        version,
        **scored,
        seconds=round(seconds, 2),
        eval_seconds=round(eval_seconds, 2),
        samples=server.counts.samples,
        strategy=config.strategy,
        **server.stats(),
        **datasets.skipped(held_out.data),
        **({f"test_{name}": round(value, 4) for name, value in tested.items()} if tested else {}),
    )


def _tested(evaluate: Evaluator, vector: torch.Tensor) -> dict[str, float] | None:
    """The final model's metrics on the test split (None without one, or when they raise: said)."""
    try:
        return evaluate.tested(vector)
    except MetricFailed as error:
        log.error("the test split's evaluation failed: %s", error)
        return None


def _scores(evaluate: Evaluator, vector: torch.Tensor, version: int, failed: set[str]) -> dict[str, float] | None:
    """The metrics of `vector`, or None when the evaluation raised: said once (each error), and
    training goes on."""
    try:
        return evaluate(vector)
    except MetricFailed as error:
        if str(error) not in failed:
            failed.add(str(error))
            log.error("evaluation at update %d failed, training goes on without it: %s", version, error)
        return None


def workers_ended(config: Config, version: int) -> str:
    """One line when every worker of this run has ended already (each one's last record an
    `end` or a `left`, one `end` at least) though no checkpoint or final.pt of the run says it
    finished: the model they trained was not saved (a full state volume, then the PS killed),
    and the PS, at `version`, would wait for them in vain and train a finished run again from
    an older state. '' otherwise, or without a run id (runs cannot be told apart)."""
    last = {}
    for rank in range(1, config.max_trainers + 1):
        records = run_records(config.metrics_dir, worker_name(rank), config.run_id)
        if records:
            last[worker_name(rank)] = records[-1].get("event")
    started = all(worker_name(rank) in last for rank in range(1, config.num_trainers + 1))
    if not started or "end" not in last.values() or any(e not in ("end", "left") for e in last.values()):
        return ""
    newest = f"version {version}" if version else "none"
    return (
        f"run {config.run_id} already ended: {', '.join(sorted(last))} finished or left "
        f"({config.metrics_dir}), but its final model was never saved (no final.pt; the newest "
        f"checkpoint: {newest}): not training a finished run again from an older state; nothing to do"
    )


class Pace:
    """The PS's pace since the previous `eval` record: updates/s, samples/s, the mean staleness
    of the pushes applied meanwhile, and the workers live now."""

    def __init__(self, server: ParameterServer) -> None:
        self.server = server
        version, samples, applied, staleness, _ = server.progress()
        self._rates = Rates(version, samples)
        self._pushes = (applied, staleness)

    def since(self) -> dict[str, float | int]:
        version, samples, applied, staleness, live = self.server.progress()
        applied_then, staleness_then = self._pushes
        self._pushes = (applied, staleness)
        mean = (staleness - staleness_then) / (applied - applied_then) if applied > applied_then else 0.0
        return {**self._rates.since(version, samples), "staleness": round(mean, 3), "workers": live}


def _gather_final(server: ParameterServer, others: ShardSet, timeout: float) -> tuple[torch.Tensor, int]:
    """The whole trained vector from every shard, retried for up to `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        own, version = server.snapshot()
        vector = others.gather(own)
        if vector is not None:
            return vector, version
        if time.monotonic() > deadline:
            raise RuntimeError(f"the shards' values could not be gathered within {timeout:.0f} s; final.pt not written")
        time.sleep(1.0)


def train_until_done(
    server: ParameterServer,
    liveness: LivenessMonitor,
    checkpoints: Checkpointer,
    evaluate: Evaluator,
    metrics: MetricsWriter,
    config: Config,
    others: ShardSet | None = None,
) -> None:
    """Serve until every worker finished, or the missing ones are past --join_timeout."""
    next_eval = (server.version // config.eval_every + 1) * config.eval_every
    pace = Pace(server)
    failed: set[str] = set()  # the evaluation errors said already
    while not server.done():
        wake_at = min(next_eval, checkpoints.next_version or next_eval)
        server.wait(wake_at, timeout=TICK_SECONDS)
        liveness.tick()
        if others is not None:
            others.tick()
        server.unblock()
        if server.version >= next_eval and not server.all_finished:
            vector: torch.Tensor | None
            vector, version, lr = server.evaluated()
            if others is not None:
                vector = others.gather(vector)  # None: a shard did not answer (one warning)
            scores = _scores(evaluate, vector, version, failed) if vector is not None else None
            if scores is not None:
                if server.observe(headline(scores)[1]):  # the record says the rate after its verdict
                    lr = server.state.lr
                    log.info("plateau: %s stalled; lr lowered to %.4g", headline(scores)[0], lr)
                since = pace.since()
                where = RunProgress(version, server.total_updates(), since["updates_per_s"], since["samples_per_s"])
                rate = f" | lr {lr:.4g}" if server.state.scheduled else ""
                progress.info("ps | Update: %d | %s%s | %s", version, line(scores), rate, where.line())
                metrics.write(
                    "eval",
                    version,
                    **fields(scores),
                    lr=lr,
                    samples=server.counts.samples,
                    **since,
                    **where.fields(),
                )
            next_eval = (version // config.eval_every + 1) * config.eval_every
        if checkpoints.due():
            checkpoints.save(f"every {counted(config.checkpoint_every, 'update')}")
