"""The command line's verbs on a cluster: build, and each target's PREFIX + up, down, logs,
status, smoke, scale, tensorboard and export (orchestrator/verbs/). Parsers only: each
verb's FUNCTION is in orchestrator/verbs/, imported on use.
"""

from __future__ import annotations

import argparse

from orchestrator.arguments import (
    add_json_arg,
    add_log_args,
    add_name_arg,
    add_resume_arg,
    add_strategy_arg,
    add_topology_args,
    completes_files,
    positive_int,
)
from orchestrator.paths import SMOKE_CONFIG


def _verbs():
    """The verbs written once on the targets' blocks (orchestrator/backends/), imported on use:
    `render` and `local` need no Docker SDK."""
    from orchestrator.verbs import board, cluster, export, scaling, smoke

    return cluster, smoke, board, export, scaling


def _end_report(backend, c, tracking_uri: str, experiment: str) -> None:
    """A cluster's report, once `logs` followed it to its end (orchestrator/metrics/end_report.py)."""
    from orchestrator.metrics import end_report

    end_report.after_cluster(backend, c, tracking_uri, experiment)


def _building():
    from orchestrator.verbs import building

    return building


def add_cluster_verbs(sub: argparse._SubParsersAction, backend) -> None:
    """PREFIX + up, down, logs, status, smoke, scale, tensorboard of one target (backends/base.py:
    `Backend`). down, logs, status, scale and tensorboard without -c act on the cluster PREFIX +
    up started last."""

    def verb(name: str) -> argparse.ArgumentParser:
        return sub.add_parser(backend.verb_prefix + name, help=backend.verb_help.get(name, name))

    p = verb("up")
    add_topology_args(p)
    _add_file_arg(p, backend, "recorded: later verbs of the run merge it too")
    p.add_argument("--offline", action="store_true", help="build (if needed) on the offline path")
    add_resume_arg(p)
    p.set_defaults(
        run=lambda a: _verbs()[0].up(
            backend,
            a.config,
            a.workers,
            strategy=a.strategy,
            offline=a.offline,
            resume=a.resume,
            name=a.name,
            overrides=tuple(a.overrides),
            files=a.files,
        )
    )
    last = f"the last {backend.verb_prefix}up"
    _add_last_cluster_verbs(verb, backend, last)
    p = verb("smoke")
    p.add_argument("-c", "--config", default=SMOKE_CONFIG, metavar="CONFIG")
    p.add_argument("--workers", type=positive_int, default=2, metavar="N")
    p.add_argument("--timeout", type=positive_int, default=backend.smoke_timeout, metavar="SECONDS")
    add_strategy_arg(p)
    add_name_arg(p, f"the topology's name: + -{backend.verb_prefix}smoke")
    p.set_defaults(
        run=lambda a: _verbs()[1].smoke(
            backend, a.config, a.workers, strategy=a.strategy, timeout=a.timeout, name=a.name
        )
    )
    p = verb("scale")
    p.add_argument("-c", "--config", metavar="CONFIG", help=f"topology file (default: {last})")
    p.add_argument("--workers", type=positive_int, required=True, metavar="N", help="the number of workers to run")
    add_name_arg(p, f"{last}'s")
    _add_file_arg(p, backend)
    p.set_defaults(run=lambda a: _verbs()[4].scale(backend, a.config, a.workers, name=a.name, files=a.files))
    _add_tensorboard_verb(verb("tensorboard"), backend, last)
    _add_export_verb(verb("export"), backend, last)


def _add_last_cluster_verbs(verb, backend, last: str) -> None:
    """down, logs and status: the cluster named by -c, else the last up's."""
    p = verb("down")
    _last_cluster_args(p, last)
    _add_file_arg(p, backend)
    p.add_argument("-v", "--volumes", action="store_true", help="also remove the volume")
    p.set_defaults(
        run=lambda a: _verbs()[0].down(
            backend, a.config, a.workers, strategy=a.strategy, volumes=a.volumes, name=a.name, files=a.files
        )
    )
    p = verb("logs")
    _last_cluster_args(p, last)
    _add_file_arg(p, backend)
    p.add_argument("--no-follow", action="store_true", help="print and return")
    add_log_args(p)
    p.set_defaults(
        run=lambda a: _verbs()[0].logs(
            backend,
            a.config,
            a.workers,
            strategy=a.strategy,
            follow=not a.no_follow,
            name=a.name,
            options=_log_options(a),
            files=a.files,
            on_end=_end_report,
        )
    )
    p = verb("status")
    _last_cluster_args(p, last)
    _add_file_arg(p, backend)
    add_json_arg(p, "the services, live workers and progress")
    p.set_defaults(
        run=lambda a: _verbs()[0].status(
            backend, a.config, a.workers, strategy=a.strategy, name=a.name, as_json=a.json, files=a.files
        )
    )


def _last_cluster_args(p: argparse.ArgumentParser, last: str) -> None:
    completes_files(p.add_argument("-c", "--config", metavar="CONFIG", help=f"topology file (default: {last})"))
    p.add_argument("--workers", type=positive_int, metavar="N")
    add_strategy_arg(p)
    add_name_arg(p, f"{last}'s; alone, the last up of that name")


def _add_file_arg(p: argparse.ArgumentParser, backend, more: str = "") -> None:
    """`-f FILE` (repeatable): compose's own override files, merged over the rendered one in
    order, as `docker compose -f` merges them."""
    completes_files(
        p.add_argument(
            "-f",
            "--file",
            dest="files",
            action="append",
            default=[],
            metavar="FILE",
            help="a compose file merged over the rendered one (a volume, a device, a variable), as `docker compose -f` "
            f"merges it; repeatable (default: the files the run's up was given){'; ' + more if more else ''}",
        )
    )


def _log_options(a: argparse.Namespace):
    from orchestrator.backends.base import LogOptions

    return LogOptions(timestamps=a.timestamps, tail=a.tail, since=a.since)


def _add_tensorboard_verb(p: argparse.ArgumentParser, backend, last: str) -> None:
    """TensorBoard on the runs' event files (orchestrator/verbs/board.py), or with --local
    a process on `make local`'s runs (orchestrator/verbs/tensorboard.py)."""
    _last_cluster_args(p, last)
    _add_file_arg(p, backend)
    p.add_argument(
        "--run", dest="run_id", metavar="ID", help="one run's curves (default: every run of the topology, side by side)"
    )
    p.add_argument("--port", type=positive_int, metavar="PORT", help="on 127.0.0.1 (default: 6006, else a free one)")
    p.add_argument("--local", action="store_true", help="a local process on the runs of `make local` (runs/<name>/)")
    p.set_defaults(
        run=lambda a: _verbs()[2].tensorboard(
            backend,
            a.config,
            a.workers,
            strategy=a.strategy,
            run=a.run_id,
            port=a.port,
            local=a.local,
            name=a.name,
            files=a.files,
        )
    )


def _add_export_verb(p: argparse.ArgumentParser, backend, last: str) -> None:
    """The run's trained model out for plain PyTorch (orchestrator/verbs/export.py)."""
    _last_cluster_args(p, last)
    p.add_argument("--run", dest="run_id", metavar="ID", help="an earlier run (default: the newest)")
    p.add_argument("--local", action="store_true", help="make local's runs (runs/<name>/) instead of a cluster's")
    p.set_defaults(
        run=lambda a: _verbs()[3].export(
            backend, a.config, a.workers, strategy=a.strategy, run=a.run_id, local=a.local, name=a.name
        )
    )


def add_build_verb(sub: argparse._SubParsersAction) -> None:
    """build: the topology's image (orchestrator/verbs/cluster.py)."""
    p = sub.add_parser("build", help="build the topology's image (Docker SDK, progress streamed)")
    add_topology_args(p)
    p.add_argument("--offline", action="store_true", help="FROM the debootstrap base, wheels from images/wheelhouse/")
    p.add_argument("-v", "--verbose", action="store_true", help="show every build output line")
    p.set_defaults(
        run=lambda a: _building().build(
            a.config, a.workers, offline=a.offline, verbose=a.verbose, overrides=tuple(a.overrides)
        )
    )
    # (build takes --name as every topology verb does; the image is the topology's whatever the name)
