"""`python -m app export`: a run's trained model out for plain PyTorch.

Reads the run's final.pt (or, for a run that did not finish, its newest good checkpoint, said in
one line) from --checkpoint_dir (or its `previous/<run id>/`, where a later run set it aside),
and writes two files to --export_dir:

- `model.pt`: the model's `state_dict` as its builder makes the model, loadable with
  `torch.load(path, weights_only=True)` and `load_state_dict(strict=True)`. A wrapper the app
  puts around a torchvision model for one-channel data (`GrayToRGB`) is not in it: the input
  step `model.json` names does its work.
- `model.json`: the builder ("module:function": `torchvision.models:resnet18` for torchvision's
  models, so that loading one needs no code of this project) and its keyword arguments; the
  input the model was trained on (channels, size, how the values are scaled and normalised,
  channels_last, a step before the model where there is one); the class names where the dataset
  has them; precision; the run id, the version and the accuracy of the run's last evaluation.

The job's flags (model, dataset, data_dir, image_size...) are those the run's PS had: the
orchestrator's export verb runs this with the PS service's environment.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from app.checkpoint import files as checkpoint_files
from app.config import Config, UsageError
from app.contract import PS, worker_name
from app.data import datasets
from app.data.imagefolder import MEAN, STD, find_samples
from app.training import models
from app.training.metrics import run_records

log = logging.getLogger("app.export")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
GRAY_TO_RGB = "x.expand(-1, 3, -1, -1): the one channel given to the model as three"


def run(config: Config) -> int:
    """Write the export of config.run_id's model (the newest run's without a run id); 0."""
    path, state = find_state(Path(config.checkpoint_dir), config.run_id)
    if path.name != "final.pt":
        log.info(
            "run %s has no final.pt (it did not finish): exporting its newest checkpoint %s, version %s",
            state.get("run_id") or "?",
            path.name,
            state.get("version"),
        )
    model = state.get("model")
    if not isinstance(model, dict) or not model:
        raise UsageError(
            f"{path}: holds no whole model (a sharded PS's checkpoint holds a slice of it); "
            "export a finished run's final.pt"
        )
    # the held-out split as the PS reads it, nothing decoded or cached: what the model takes
    held_out = datasets.load(config.dataset, config.data_dir, "test", config.seed, config.image_size, "off")
    built = models.build(config.model, int(state.get("channels", held_out.channels)), held_out.num_classes, config.seed)
    weights, step = unwrapped(built, model)
    out = Path(config.export_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out / "model.pt")
    card = {
        **builder(config.model, held_out.channels, held_out.num_classes),
        "input": {**describe_input(held_out.data), "channels_last": config.channels_last, **step},
        "classes": class_names(config, held_out.num_classes),
        "precision": config.precision,
        "run_id": state.get("run_id", ""),
        "version": int(state.get("version", 0)),
        "finished": path.name == "final.pt",
        "accuracy": last_accuracy(config, str(state.get("run_id", ""))),
        "source": str(path),
    }
    (out / "model.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
    log.info("exported %s (version %s) to %s: model.pt and model.json", path.name, card["version"], out)
    return 0


def find_state(directory: Path, run_id: str) -> tuple[Path, dict[str, Any]]:
    """The file to export and what it holds: `run_id`'s final.pt, else its newest good
    checkpoint; in `directory` or, when a later run set the run aside, `previous/<run id>/`.
    Without a run id, the newest run's. UsageError naming what exists when there is none."""
    places = [directory]
    if run_id:
        places += sorted((directory / checkpoint_files.PREVIOUS).glob(f"{run_id}*"))
    for place in places:
        final = checkpoint_files.final_state(place)
        if final is not None and (not run_id or final.get("run_id") == run_id):
            return place / "final.pt", torch.load(place / "final.pt", map_location="cpu", weights_only=True)
        newest = checkpoint_files.newest_good(place)
        if newest is not None and (not run_id or newest[1].get("run_id") == run_id):
            return newest
    runs = sorted(p.name for p in (directory / checkpoint_files.PREVIOUS).glob("*"))
    have = f"; earlier runs set aside: {', '.join(runs)}" if runs else ""
    which = f"run {run_id}" if run_id else "any run"
    raise UsageError(f"no final.pt or checkpoint of {which} in {directory}{have}")


def unwrapped(built: nn.Module, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`state` (the trained model's, as the app built it) loaded into `built`, and the state
    dict of the model its builder makes: without the app's GrayToRGB wrapper, whose work
    becomes an input step (returned, for model.json)."""
    built.load_state_dict(state, strict=True)
    if isinstance(built, nn.Sequential) and len(built) == 2 and isinstance(built[0], models.GrayToRGB):
        return dict(built[1].state_dict()), {"step": GRAY_TO_RGB}
    return dict(built.state_dict()), {}


def builder(name: str, channels: int, num_classes: int) -> dict[str, Any]:
    """How to build the model empty: "module:function" and its keyword arguments."""
    if name == "cnn":
        return {"builder": "app.training.models:SmallCNN", "kwargs": {"channels": channels, "num_classes": num_classes}}
    if ":" in name:  # the user's own factory(num_classes, channels) (app/plugins.py)
        return {"builder": name, "kwargs": {"num_classes": num_classes, "channels": channels}}
    extra = {"aux_logits": False} if name in models.AUX_LOGITS else {}
    return {"builder": f"torchvision.models:{name}", "kwargs": {"num_classes": num_classes, **extra}}


def describe_input(data: Dataset) -> dict[str, Any]:
    """What the held-out split gives the model: its shape and how its values are made."""
    if isinstance(data, datasets.InMemoryData):
        return {
            "size": list(data.x.shape[-2:]),
            "scale": data.scale,
            "mean": data.mean.flatten().tolist(),
            "std": data.std.flatten().tolist(),
            "values": "x * scale, then (x - mean) / std per channel",
        }
    crop = getattr(data, "crop", None)
    if crop is not None:  # an image folder, decoded or cached
        return {
            "size": [crop, crop],
            "resize": round(crop * 8 / 7),
            "scale": 1 / 255,
            "mean": MEAN.flatten().tolist(),
            "std": STD.flatten().tolist(),
            "values": "RGB, the shorter side resized to `resize` (bilinear), the centre crop of `size`, "
            "x * scale, then (x - mean) / std per channel",
        }
    return {"values": "as the dataset's own factory gives them"}


def class_names(config: Config, num_classes: int) -> list[str] | None:
    """The class names where the dataset has them (None: a user's dataset, synthetic)."""
    if config.dataset in ("digits", "mnist"):
        return [str(i) for i in range(num_classes)]
    if config.dataset == "cifar10":
        return list(CIFAR10_CLASSES)
    if config.dataset == "imagefolder":
        root = Path(config.data_dir)
        classes, _ = find_samples(root / "train" if (root / "train").is_dir() else root)
        return classes
    return None


def last_accuracy(config: Config, run_id: str) -> float | None:
    """The accuracy of the run's last evaluation (its `end` record, else its last `eval`), from
    the PS's metrics (an allreduce job's: worker1's)."""
    for name in (PS, worker_name(1)):
        records = [r for r in run_records(config.metrics_dir, name, run_id) if r.get("event") in ("eval", "end")]
        if records:
            return records[-1].get("accuracy")
    return None
