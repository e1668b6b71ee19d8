"""The tensorboard verb, once for every target: TensorBoard on the event files of the cluster
`up` started last (or -c's), every run side by side or one (`run`), on 127.0.0.1 at a free
port; with `local`, a process on the runs of `make local` (orchestrator/verbs/tensorboard.py).

Refused with one line before anything starts: the image not built yet (`make up` or `make
build` first), or a run id that is not among the cluster's runs (the ones that exist are
listed). With no run yet it starts, and says the page fills once `make up` trains."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, TextIO

import yaml

from app.contract import Event
from orchestrator import images
from orchestrator.backends.base import Backend, Cluster
from orchestrator.errors import UsageError, engine_errors
from orchestrator.hints import command
from orchestrator.metrics.records import is_event, parse_lines
from orchestrator.render.compose import TENSORBOARD_PORT, TENSORBOARD_RUN
from orchestrator.topology.services import PS_SERVICE
from orchestrator.verbs import tensorboard as board
from orchestrator.verbs.cluster import keep_document, resolve


def image_of(c: Cluster) -> Optional[str]:
    """The image the cluster's services run: the topology's, else the rendered document's."""
    if c.topology is not None:
        return c.topology.image_tag
    try:
        doc = yaml.safe_load(Path(c.file).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return None
    found = [s.get("image") for s in (doc.get("services") or {}).values() if isinstance(s, dict)]
    return next((i for i in found if i), None)


def run_ids(records: dict[str, list[str]]) -> list[str]:
    """The run ids the cluster's processes wrote into their `start` records, oldest first."""
    ids: dict[str, None] = {}
    for lines in records.values():
        for rec in parse_lines(lines):
            if is_event(rec, Event.START) and rec.get("run_id"):
                ids[str(rec["run_id"])] = None
    return sorted(ids)


def _refuse_early(backend: Backend, c: Cluster, run: str) -> list[str]:
    """UsageError when the image is missing or `run` is not one of the cluster's runs; the runs."""
    if backend.engine:
        tag = image_of(c)
        if tag is not None and not images.image_exists(images.client(), tag):
            raise UsageError(
                f"tensorboard: image {tag} of {backend.noun} {c.name} is not built yet; "
                f"run {command(backend.verb('up'))} (or {command('build')}) first"
            )
    ids = run_ids(backend.read_records(c, PS_SERVICE))
    if run and run not in ids:
        have = f"its runs: {', '.join(ids)}" if ids else f"it has no run yet ({command(backend.verb('up'))} starts one)"
        raise UsageError(f"RUN={run}: no such run in {backend.noun} {c.name}; {have}")
    return ids


@engine_errors
def tensorboard(
    backend: Backend,
    config: Optional[str] = None,
    workers: Optional[int] = None,
    *,
    strategy: Optional[str] = None,
    run: Optional[str] = None,
    port: Optional[int] = None,
    local: bool = False,
    name: Optional[str] = None,
    out: Optional[TextIO] = None,
    files: Sequence[str] = (),
) -> int:
    out = out or sys.stdout
    backend.refuse("tensorboard")
    if local:
        from orchestrator.verbs.local import topology_of

        t = topology_of(config, workers, strategy, name)
        return board.run_local(t, run, port)
    run = board.check_run(run)
    c = resolve(backend, config, workers, strategy, name, files)
    ids = _refuse_early(backend, c, run)
    keep_document(backend, c)
    chosen = board.choose_port(port)
    see = backend.serve_board(c, {TENSORBOARD_RUN: run, TENSORBOARD_PORT: str(chosen)})
    if not board.wait_until_answers(chosen):
        raise UsageError(
            f"tensorboard of {backend.noun} {c.name} did not answer on {board.url(chosen)} within "
            f"{board.ANSWER_TIMEOUT:.0f} s: {see}"
        )
    what = f"run {run}" if run else "every run"
    print(
        f"==> tensorboard: {board.url(chosen)} ({what} of {backend.noun} {c.name}); "
        f"{command(backend.verb('down'))} stops it",
        file=out,
        flush=True,
    )
    if not ids:
        print(
            f"    no run has written its curves yet: {command(backend.verb('up'))} starts one, and the page fills "
            "as it trains (reload it)",
            file=out,
            flush=True,
        )
    return 0
