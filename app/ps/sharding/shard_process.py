"""A PS shard's process (`python -m app ps --shard I`, app.ps.sharding.slices): claim a name, join,
resume from the checkpoint the main PS names, register, serve its slice until the main PS
says training ended."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app import plugins
from app.checkpoint import files as checkpoint_files
from app.checkpoint.writer import Checkpointer
from app.config import Config, UsageError
from app.contract import PS
from app.data import datasets
from app.exchange import group, transport
from app.ps import rpc as endpoints
from app.ps.rpc import Endpoint, Shard
from app.ps.server import ParameterServer
from app.ps.sharding.slices import MainPSLost, bounds
from app.runtime.words import first_line
from app.training import models
from app.training.flat import state_size
from app.training.metrics import MetricsWriter

log = logging.getLogger("app.ps")
PING_SECONDS = 1.0
TICK_SECONDS = 0.25


def checkpoint_labelled(directory: str | Path, version: int) -> tuple[Path, dict[str, Any]] | None:
    """The newest good checkpoint in `directory` labelled `version` by the main PS."""
    for path in checkpoint_files.listing(directory):
        try:
            state = checkpoint_files.verify(path)
        except (ValueError, OSError) as error:
            log.warning("skipping checkpoint %s: %s", path, error)
            continue
        if state.get("label") == version:
            return path, state
    return None


def newest_on_exit(directory: str | Path, run_id: str) -> tuple[Path, dict[str, Any]] | None:
    """The newest good checkpoint in `directory` this shard wrote on exit in run `run_id`
    (any run when it is '')."""
    for path in checkpoint_files.listing(directory):
        try:
            state = checkpoint_files.verify(path)
        except (ValueError, OSError) as error:
            log.warning("skipping checkpoint %s: %s", path, error)
            continue
        if state.get("exit") and (not run_id or state.get("run_id", "") == run_id):
            return path, state
    return None


def resume_shard(server: ParameterServer, directory: str | Path, resumed: tuple[int, str] | int | None) -> str:
    """Restore the shard's checkpoint labelled with the main PS's version; else, when the
    processes were stopped (each wrote its own slice on the way out, the versions a few
    pushes apart), the newest this shard wrote on exit in the run of the main PS's
    checkpoint. `resumed`: (version, run id) of the main PS's newest checkpoint (a bare
    version: any run). What was done, for the log. RuntimeError (exit 1) when it has neither."""
    if resumed is None:
        return "the main parameter server starts a new run: starting from the initial values"
    version, run_id = resumed if isinstance(resumed, tuple) else (resumed, "")
    found = checkpoint_labelled(directory, version)
    if found is not None:
        path, state = found
        server.restore(state)
        return f"resumed from {path.name} (the main parameter server's version {version})"
    found = newest_on_exit(directory, run_id)
    if found is None:
        raise RuntimeError(
            f"no checkpoint labelled {version} in {directory}, nor one written on exit in run "
            f"{run_id or '(any)'}: cannot resume with the main parameter server's checkpoint"
        )
    path, state = found
    server.restore(state)
    return (
        f"resumed from {path.name}, written on exit at this shard's version {state['version']} "
        f"(the main parameter server's: {version}; pushes in flight when they stopped)"
    )


def run(config: Config) -> int:
    """Shard `config.shard` of `config.shards`: serve its slice until the main PS says the end."""
    index, k = config.shard, config.shards
    models.check(config.model)
    held_out = datasets.load(config.dataset, config.data_dir, "test", config.seed, config.image_size)
    model = models.build(config.model, held_out.channels, held_out.num_classes, config.seed)
    if config.init_weights:  # this shard's slice starts from the same weights as the main PS's
        plugins.load_weights(model, config.init_weights)
    part = bounds(state_size(model), k)[index]
    server = ParameterServer.from_config(config, model, part, f"shard {index}")
    log.info(
        "shard %d of %d: values %d..%d of %d (%d parameter values)",
        index,
        k,
        *part,
        server.state.flat.size,
        server.state.num_params,
    )
    identity = dict(
        model_name=config.model,
        dataset=config.dataset,
        channels=held_out.channels,
        num_classes=held_out.num_classes,
        world_size=config.world_size,
        shards=k,
        shard=index,
        run_id=config.run_id,
    )
    # its own directory; the main PS says when to checkpoint (rpc_checkpoint)
    own = dataclasses.replace(
        config, checkpoint_dir=str(Path(config.checkpoint_dir) / f"shard{index}"), checkpoint_every=0
    )
    shard = Shard()  # what the main PS's calls to this shard reach: its checkpoints, the end
    with MetricsWriter(config.metrics_dir, config.name, "ps", 0) as metrics:
        checkpoints = Checkpointer(server, own, identity, metrics)
        checkpoint_files.check_writable(own.checkpoint_dir)  # creates it when missing
        checkpoint_files.remove_temp_files(own.checkpoint_dir)
        group.wait_for_ps(config, config.join_timeout, who=f"shard {index}")
        name, rpc_id = group.claim_shard_identity(config)
        metrics.start(config)
        with Endpoint(server, shard=shard).serving(), transport.session(config, rank=rpc_id, name=name):
            _resume_from_main(server, config, own.checkpoint_dir, metrics, name)
            with shard.checkpointing(functools.partial(_save_labelled, server, identity, own.checkpoint_dir)):
                error = _call_main(config, endpoints.rpc_register, index, name, k, part)
                if error:  # this shard is not one of the main PS's job
                    raise UsageError(error)
                address = group.where(config)
                try:
                    _serve_until_ended(server, checkpoints, config, address, shard.ended)
                except BaseException:  # SIGTERM (SystemExit), the main PS lost: keep this slice
                    _save_on_exit(server, identity, own.checkpoint_dir)
                    raise
            state = {**server.checkpoint(), **identity, "finished": shard.finished}
            try:
                path = checkpoint_files.save(state, own.checkpoint_dir)
            except OSError as error:  # a full volume: the main PS's final.pt holds the whole model
                log.warning(
                    "%s: training ended; its last checkpoint (version %d) not written: %s",
                    name,
                    state["version"],
                    first_line(error),
                )
            else:
                log.info("%s: training ended; last checkpoint %s (version %d)", name, path.name, state["version"])
        metrics.write("end", server.version, **server.stats())
    return 0


def _call_main(config: Config, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` on the main PS, its answer; MainPSLost when it cannot be reached."""
    try:
        return transport.call(PS, function, args, timeout=config.rpc_timeout)
    except RuntimeError as lost:
        address = group.where(config)
        raise MainPSLost(f"lost the main parameter server at {address}: {first_line(lost)}") from None


def _resume_from_main(
    server: ParameterServer, config: Config, directory: str, metrics: MetricsWriter, name: str
) -> None:
    """Take this shard's slice back from the checkpoint labelled with the main PS's newest."""
    resumed = _call_main(config, endpoints.rpc_resumed)
    log.info("%s: %s", name, resume_shard(server, directory, resumed))
    if server.version:
        metrics.write("resume", server.version, label=resumed[0] if isinstance(resumed, tuple) else resumed)


def _serve_until_ended(
    server: ParameterServer, checkpoints: Checkpointer, config: Config, address: str, ended: threading.Event
) -> None:
    """Serve until the main PS says training `ended`; MainPSLost when it stops answering pings."""
    last_ping = time.monotonic()
    while not ended.is_set():
        server.wait(checkpoints.next_version or server.version + (1 << 62), timeout=TICK_SECONDS)
        server.unblock()
        if time.monotonic() - last_ping >= PING_SECONDS and not ended.is_set():
            try:
                transport.call(PS, group.pong, timeout=config.rpc_timeout)
            except RuntimeError as error:
                if ended.is_set():
                    return
                raise MainPSLost(f"lost the main parameter server at {address}: {first_line(error)}") from None
            last_ping = time.monotonic()


def _save_on_exit(server: ParameterServer, identity: dict[str, Any], directory: str) -> None:
    """This shard's own checkpoint as it stops (SIGTERM, or the main PS lost): the main PS
    cannot collect it then (it may be stopping too, or stopped first). A restart resumes
    it when the main PS's checkpoint has no slice labelled with its version."""
    if server.version == 0:
        return  # nothing applied: nothing to keep
    try:
        path = checkpoint_files.save({**server.checkpoint(), **identity, "exit": True}, directory)
    except OSError as error:
        log.warning("checkpoint on exit at version %d not written: %s", server.version, first_line(error))
        return
    log.info("checkpoint %s (on exit, version %d)", path.name, server.version)


def _save_labelled(server: ParameterServer, identity: dict[str, Any], directory: str, version: int) -> str | None:
    """This shard's checkpoint, labelled with the main PS's `version`; an error line, or None."""
    try:
        path = checkpoint_files.save({**server.checkpoint(), **identity, "label": version}, directory)
    except OSError as error:
        log.warning("checkpoint labelled %d not written: %s", version, error)
        return first_line(error)
    log.info("checkpoint %s (labelled %d by the main parameter server)", path.name, version)
    return None
