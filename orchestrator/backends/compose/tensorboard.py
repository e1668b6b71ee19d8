"""`make tensorboard` on compose: the project's `tensorboard` service (a profile `up` never
activates; orchestrator/render/compose.py) started on the state volume, read-only, published
on 127.0.0.1 at a free port; `make down` removes it with the rest of the project."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, TextIO

import yaml

from orchestrator import images
from orchestrator import tensorboard as board
from orchestrator.backends.compose import adapter
from orchestrator.backends.compose.verbs import render_if_needed, target
from orchestrator.errors import UsageError, engine_errors
from orchestrator.render import compose


def _has_service(path: Path) -> bool:
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return False
    return compose.TENSORBOARD_SERVICE in (doc.get("services") or {})


@engine_errors
def start(
    config: Optional[str] = None,
    workers: Optional[int] = None,
    *,
    strategy: Optional[str] = None,
    run: Optional[str] = None,
    port: Optional[int] = None,
    project: Optional[str] = None,
    out: TextIO = sys.stdout,
) -> int:
    """TensorBoard for the cluster `up` started last (or `-c`): every run of the project, or
    run `run`; the URL once it answers."""
    run = board.check_run(run)
    tg = target(config, workers, project=project, strategy=strategy)
    images.client()
    path = Path(tg.project.file)
    if tg.topology is not None:
        render_if_needed(tg.topology, path)
    elif not _has_service(path):
        raise UsageError(f"{path}: no tensorboard service in it (rendered before there was one): make up renders it")
    chosen = board.choose_port(port)
    env = {compose.TENSORBOARD_RUN: run, compose.TENSORBOARD_PORT: str(chosen)}
    adapter.run(adapter.tensorboard_argv(adapter.detect(), tg.project), env=env)
    if not board.wait_until_answers(chosen):
        raise UsageError(
            f"tensorboard of project {tg.project.name} did not answer on {board.url(chosen)} within "
            f"{board.ANSWER_TIMEOUT:.0f} s: docker logs {tg.project.name}-{compose.TENSORBOARD_SERVICE}-1"
        )
    what = f"run {run}" if run else "every run"
    print(
        f"==> tensorboard: {board.url(chosen)} ({what} of project {tg.project.name}); make down stops it",
        file=out,
        flush=True,
    )
    return 0
