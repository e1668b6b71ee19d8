"""The app run whole, as a user runs it, for the benches that time `python -m app` itself: as
processes through `python -m orchestrator local` in a scratch directory (its runs/ stays out of
the checkout), or in compose under a project of its own, never another run's containers or
`runs/current.json`, removed with its volume afterwards. Each returns the run's metrics
files' lines (`{file name: lines}`). Compose needs a Docker engine (`make engine`)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import harness

ROOT = Path(__file__).resolve().parent.parent


def local_metrics(config: dict[str, Any] | Path, timeout: float, extra: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """`python -m orchestrator local -c CONFIG [extra...]`; `config` a topology (written to the
    scratch directory) or a file."""
    import yaml

    with tempfile.TemporaryDirectory(prefix="bench-local-") as tmp:
        if isinstance(config, dict):
            path = Path(tmp, "topology.yaml")
            path.write_text(yaml.safe_dump(config))
            config = path
        argv = [sys.executable, "-m", "orchestrator", "local", "-c", str(config), *extra]
        env = dict(os.environ, PYTHONPATH=harness.python_path(ROOT))
        proc = subprocess.Popen(
            argv, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            raise RuntimeError(f"orchestrator local did not finish within {timeout:.0f} s") from None
        if proc.returncode != 0:
            tail = " | ".join(out.decode(errors="replace").strip().splitlines()[-3:])
            raise RuntimeError(f"orchestrator local exited {proc.returncode}: {tail}")
        metrics = next(Path(tmp, "runs").glob("*/metrics"))
        return {f.name: f.read_text().splitlines() for f in metrics.glob("*.jsonl")}


def build_image(model: Any) -> None:
    """The topology's image, FROM the offline base (the layer cache makes a rebuild quick)."""
    from orchestrator import images

    base, pip_source = images.source(model, offline=True)
    images.build(model.image_tag, base, pip_source, out=io.StringIO())


def compose_metrics(model: Any, project: str, timeout: float) -> dict[str, list[str]]:
    """The topology `model` (its image built) rendered for compose and run under `project`
    until every service has exited; the project and its volume are removed afterwards,
    whatever happened."""
    from orchestrator import images
    from orchestrator.backends import command
    from orchestrator.backends.compose import adapter
    from orchestrator.render import compose
    from orchestrator.render.yamlio import write_atomic
    from orchestrator.topology.services import service_names

    client = images.client()
    found = adapter.detect()
    with tempfile.TemporaryDirectory(prefix="bench-compose-") as tmp:
        proj = adapter.Project(project, str(Path(tmp) / "compose.yaml"), str(ROOT))
        try:
            write_atomic(proj.file, compose.dump(compose.render(model), model.name))
            command.run(adapter.up_argv(found, proj), capture=True)
            finished = adapter.wait_exited(client, project, len(service_names(model)), timeout, io.StringIO())
            if finished is None:
                raise RuntimeError(f"the compose run did not end within {timeout:.0f} s")
            return adapter.read_metrics(client, project, adapter.containers(client, project))
        finally:
            command.run(adapter.down_argv(found, proj, volumes=True), capture=True, check=False)
