"""`python -m app export`: a run's trained model out for plain PyTorch.

Reads the run's final.pt (or, for a run that did not finish or whose final.pt does not load,
its newest good checkpoint, said in one line: why, and which) from --checkpoint_dir (or its
`previous/<run id>/`, where a later run set it aside), and writes two files to --export_dir:

`model.pt` (the state dict as the model's builder makes it) and `model.json` (how to build it
and feed it): app/checkpoint/export_files.py; `model.pt2` (a torch.export program, which needs
no code of this project to run) and `model.safetensors` (model.pt's weights, with no pickle):
app/checkpoint/export_formats.py.

The job's flags (model, dataset, data_dir, image_size...) are those the run's PS had: the
orchestrator's export verb runs this with the PS service's environment.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from app.checkpoint import export_files, export_formats
from app.checkpoint import files as checkpoint_files
from app.config import Config, UsageError
from app.contract import PS, worker_name
from app.data import datasets
from app.publish import publish
from app.training import losses, models
from app.training.evaluate import evaluate, fields, line
from app.training.metrics import run_records

log = logging.getLogger("app.export")


def run(config: Config) -> int:
    """Write the export of config.run_id's model (the newest run's without a run id); 0. Its
    label (version, metrics) is the exported file's: the PS's evaluation at that version, else
    one made here on the held-out split."""
    notes: list[str] = []
    path, state = find_state(Path(config.checkpoint_dir), config.run_id, notes)
    version = int(state.get("version", 0))
    if path.name != "final.pt":
        log.info(
            "run %s %s: exporting its newest checkpoint %s, version %s",
            state.get("run_id") or "?",
            notes[0] if notes else "has no final.pt (it did not finish)",
            path.name,
            version,
        )
    model = state.get("model")
    if not isinstance(model, dict) or not model:
        raise UsageError(
            f"{path}: holds no whole model (a sharded PS's checkpoint holds a slice of it); "
            "export a finished run's final.pt"
        )
    # the held-out split as the PS reads it, nothing decoded or cached: what the model takes
    held_out = datasets.load(config.dataset, config.data_dir, "test", config.seed, config.image_size, "off")
    run_id = str(state.get("run_id", ""))
    scores = scores_at(config, run_id, version)
    if scores is None:
        own = evaluated(config, model, held_out)
        log.info("the run's records hold no evaluation at version %d; evaluated here: %s", version, line(own))
        scores = fields(own)
    written = export_files.files(
        config,
        model,
        held_out,
        run_id=run_id,
        version=version,
        finished=path.name == "final.pt",
        **export_files.scored(scores),
        source=str(path),
    )
    written = formats(config, model, held_out, written)
    out = publish(written, Path(config.export_dir))
    log.info("exported %s (version %s) to %s: %s", path.name, version, out, " and ".join(written))
    return 0


def formats(
    config: Config, model: dict[str, torch.Tensor], held_out: datasets.LabeledData, written: dict[str, bytes]
) -> dict[str, bytes]:
    """`written` with the formats that need no code of this project (app/checkpoint/export_formats.py);
    each one that cannot be made is said in one line, and in model.json."""
    plain = export_files.plain_model(config, model, held_out)
    more: dict[str, bytes] = {"model.safetensors": export_formats.weights(plain)}
    why_not: dict[str, str] = {}
    step = json.loads(written["model.json"])["input"].get("step")
    try:
        x = export_formats.examples(held_out, gray_to_rgb=step == export_files.GRAY_TO_RGB)
    except (TypeError, IndexError) as error:  # a stream: no sample by index
        x, why_not["model.pt2"] = None, f"the held-out split gives no sample to trace it with ({error})"
    if x is not None:
        program, why = export_formats.program(plain, x)
        if program is not None:
            more["model.pt2"] = program
        else:
            why_not["model.pt2"] = why
    for name, why in why_not.items():
        log.warning("%s not written: %s", name, why)
    return export_files.with_formats(written, more, why_not)


def find_state(directory: Path, run_id: str, notes: list[str] | None = None) -> tuple[Path, dict[str, Any]]:
    """The file to export and what it holds: `run_id`'s final.pt, else its newest good
    checkpoint; in `directory` or, when a later run set the run aside, `previous/<run id>/`.
    Without a run id, the newest run's. UsageError naming what exists when there is none.
    `notes`: why a final.pt beside the checkpoint chosen was passed over (it does not load)."""
    places = [directory]
    if run_id:
        places += sorted((directory / checkpoint_files.PREVIOUS).glob(f"{run_id}*"))
    for place in places:
        final = checkpoint_files.final_state(place)
        if final is not None and (not run_id or final.get("run_id") == run_id):
            return place / "final.pt", torch.load(place / "final.pt", map_location="cpu", weights_only=True)
        if final is None and (place / "final.pt").is_file() and notes is not None:
            notes.append("has a final.pt that does not load (cut short or damaged, the warning above)")
        newest = checkpoint_files.newest_good(place)
        if newest is not None and (not run_id or newest[1].get("run_id") == run_id):
            return newest
    runs = sorted(p.name for p in (directory / checkpoint_files.PREVIOUS).glob("*"))
    have = f"; earlier runs set aside: {', '.join(runs)}" if runs else ""
    which = f"run {run_id}" if run_id else "any run"
    raise UsageError(f"no final.pt or checkpoint of {which} in {directory}{have}")


def scores_at(config: Config, run_id: str, version: int) -> dict[str, Any] | None:
    """The run's evaluation at `version` (its `end` record, or an `eval`), from the PS's metrics
    (an allreduce job's: worker1's); None when there is none at that version."""
    for name in (PS, worker_name(1)):
        records = [
            r
            for r in run_records(config.metrics_dir, name, run_id)
            if r.get("event") in ("eval", "end") and r.get("step") == version
        ]
        if records:
            return records[-1]
    return None


def evaluated(config: Config, model: dict[str, torch.Tensor], held_out: datasets.LabeledData) -> dict[str, float]:
    """The metrics of the state dict `model` on the held-out split, as the PS evaluates (CPU)."""
    built = models.build(config.model, held_out.channels, held_out.num_classes, config.seed)
    built.load_state_dict(model, strict=True)
    loader = datasets.eval_loader(held_out.data, config.held_out_batch, 0)
    return evaluate(built, loader, torch.device("cpu"), config.metrics, losses.build(config.loss))
