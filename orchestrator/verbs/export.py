"""The export verb, once for every target: a run's trained model out for plain PyTorch, as
`runs/<name>/model/model.pt` (a state_dict) and `model.json` (how to build and feed the model),
written by the app's export role (app/export.py) where the run's state is: the cluster's state
volume (the target's `export_model` block), or with `local` the state of `make local`'s runs.

The run: `run`, else the newest one the cluster's metrics name. Its final model, or, for a run
that did not finish, its newest checkpoint, said in one line. Refused with one line before
anything starts: a run id that is not the cluster's (the ones that exist are listed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional, TextIO

from orchestrator import paths
from orchestrator.backends.base import Backend
from orchestrator.errors import UsageError, engine_errors
from orchestrator.hints import command
from orchestrator.topology.services import PS_SERVICE
from orchestrator.verbs.board import run_ids
from orchestrator.verbs.cluster import resolve

MODEL_DIR = "model"  # runs/<name>/model/
LOAD_DOC = "docs/running.md#export-the-trained-model-and-track-runs-in-mlflow"


@engine_errors
def export(
    backend: Backend,
    config: Optional[str] = None,
    workers: Optional[int] = None,
    *,
    strategy: Optional[str] = None,
    run: Optional[str] = None,
    local: bool = False,
    name: Optional[str] = None,
    out: Optional[TextIO] = None,
) -> int:
    out = out or sys.stdout
    if local:
        from orchestrator.verbs.local import RUNS_DIR, topology_of

        t = topology_of(config, workers, strategy, name)

        state = Path(RUNS_DIR) / t.name  # where make local keeps it (runs/, from where it runs)
        into = state / MODEL_DIR
        run_id = _chosen(run, _local_runs(state / "metrics"), f"make local's runs of {t.name} ({state}/)")
        _export_local(t, state, run_id, into)
        where = f"make local's {t.name}"
    else:
        backend.refuse("export")
        c = resolve(backend, config, workers, strategy, name)
        from orchestrator.verbs.local import RUNS_DIR

        local_ids = _local_runs(Path(RUNS_DIR) / c.name / "metrics")
        aside = (
            f"make local's runs of {c.name} ({Path(RUNS_DIR) / c.name}/): export one with --local "
            f"({command('export', LOCAL=1)}), newest {local_ids[-1]}"
            if local_ids
            else ""
        )
        ids = run_ids(backend.read_records(c, PS_SERVICE))
        if not ids and not run and aside:
            raise UsageError(f"export: {backend.noun} {c.name} has no run yet (no metrics); {aside}")
        run_id = _chosen(run, ids, f"{backend.noun} {c.name}")
        into = paths.RUNS / c.name / MODEL_DIR
        backend.export_model(c, run_id, into)
        where = f"{backend.noun} {c.name}"
        if aside:
            print(f"export: {where}'s run, not {aside}", file=out, flush=True)
    card = json.loads((into / "model.json").read_text(encoding="utf-8"))
    what = "its final model" if card.get("finished") else "its newest checkpoint (the run did not finish)"
    run_id = card.get("run_id") or "(no id)"
    metric = card.get("headline") or "accuracy"
    value = (card.get("metrics") or {}).get(metric, card.get("accuracy"))
    print(
        f"==> export: run {run_id} of {where}, version {card.get('version')}, {what}, {metric} "
        f"{value}: {into}/model.pt and model.json ({card.get('builder')}; to load it: {LOAD_DOC})",
        file=out,
        flush=True,
    )
    return 0


def _chosen(run: Optional[str], ids: list[str], where: str) -> str:
    """`run` when it is one of `ids` (UsageError naming them when not), else the newest."""
    if run and run not in ids:
        have = f"its runs: {', '.join(ids)}" if ids else "it has no run yet"
        raise UsageError(f"RUN={run}: no such run in {where}; {have}")
    if not run and not ids:
        raise UsageError(f"export: {where} has no run yet (no metrics): nothing to export")
    return run or ids[-1]


def _local_runs(metrics: Path) -> list[str]:
    """The run ids of make local's runs, oldest first (from the PS's or worker1's records)."""
    lines: dict[str, list[str]] = {}
    for name in ("ps.jsonl", "worker1.jsonl"):
        try:
            lines[name] = (metrics / name).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
    return run_ids(lines) if lines else []


def _export_local(t, state: Path, run_id: str, into: Path) -> None:
    """`python -m app export` with the environment make local's PS (or worker1) had."""
    from orchestrator.verbs import local

    env = local.export_environment(t, state, run_id, into)
    result = subprocess.run(local.app_argv("export"), env=env, capture_output=True, text=True)
    if result.returncode != 0:
        said = result.stderr.strip().splitlines()
        raise UsageError(f"export of make local's {t.name} failed: {said[-1] if said else result.returncode}")
