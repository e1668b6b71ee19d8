"""A trained model as plain PyTorch loads it: `model.pt` and `model.json` (app/export.py writes
them for a run; the PS hands them to its tracker at the end).

- `model.pt`: the model's `state_dict` as its builder makes the model, loadable with
  `torch.load(path, weights_only=True)` and `load_state_dict(strict=True)`. A wrapper the app
  puts around a torchvision model for one-channel data (`GrayToRGB`) is not in it: the input
  step `model.json` names does its work.
- `model.json`: the builder ("module:function": `torchvision.models:resnet18` for torchvision's
  models, so that loading one needs no code of this project) and its keyword arguments; the
  input the model was trained on (channels, size, how the values are scaled and normalised,
  channels_last, a step before the model where there is one); the class names where the dataset
  has them; precision; the run id, the version and the metrics of the run's last evaluation
  (`metrics`, its `headline` first; `accuracy` too where it is one).
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from app.config import Config
from app.data import builtin, datasets, text
from app.data.imagefolder import MEAN, STD, find_samples
from app.training import models

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
GRAY_TO_RGB = "x.expand(-1, 3, -1, -1): the one channel given to the model as three"


def files(
    config: Config, trained: dict[str, torch.Tensor], held_out: datasets.LabeledData, **about: Any
) -> dict[str, bytes]:
    """model.pt and model.json (name -> bytes) of the model `trained` (its state dict as the app
    built it), trained on data like `held_out`; `about`: run_id, version, finished, the metrics
    (`scored`), source, as model.json says them."""
    built = models.build(config.model, held_out.channels, held_out.num_classes, config.seed)
    weights, step = unwrapped(built, trained)
    card = {
        **builder(config.model, held_out.channels, held_out.num_classes),
        "input": {
            "channels": held_out.channels,
            **describe_input(held_out.data),
            "channels_last": config.channels_last,
            **step,
        },
        "classes": class_names(config, held_out.num_classes),
        "precision": config.precision,
        **about,
    }
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    return {"model.pt": buffer.getvalue(), "model.json": (json.dumps(card, indent=2) + "\n").encode()}


def scored(record: Mapping[str, Any] | None) -> dict[str, Any]:
    """model.json's metrics from an `eval` or `end` record (app.training.evaluate.fields): the
    headline's name, every metric, and `accuracy` where it is one; nothing without a record."""
    if not record:
        return {"accuracy": None}
    names = record.get("metrics") or ["accuracy"]
    metrics = {name: record.get(name) for name in names}
    return {
        "headline": names[0],
        "metrics": metrics,
        **({"accuracy": metrics["accuracy"]} if "accuracy" in metrics else {}),
    }


def plain_model(config: Config, trained: dict[str, torch.Tensor], held_out: datasets.LabeledData) -> nn.Module:
    """The trained model as its builder makes it (without the app's GrayToRGB wrapper)."""
    built = models.build(config.model, held_out.channels, held_out.num_classes, config.seed)
    built.load_state_dict(trained, strict=True)
    if isinstance(built, nn.Sequential) and len(built) == 2 and isinstance(built[0], models.GrayToRGB):
        return built[1]
    return built


def with_formats(written: dict[str, bytes], more: dict[str, bytes], why_not: dict[str, str]) -> dict[str, bytes]:
    """`written` (model.pt and model.json) and the files of `more`, model.json saying which
    formats could not be made and why (`not_exported`)."""
    card = json.loads(written["model.json"])
    card["files"] = sorted([*written, *more])
    if why_not:
        card["not_exported"] = why_not
    return {**written, **more, "model.json": (json.dumps(card, indent=2) + "\n").encode()}


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
    if name == "char_transformer":
        return {"builder": "app.training.transformer:CharTransformer", "kwargs": {"num_classes": num_classes}}
    if ":" in name:  # the user's own factory(num_classes, channels) (app/plugins.py)
        return {"builder": name, "kwargs": {"num_classes": num_classes, "channels": channels}}
    extra = {"aux_logits": False} if name in models.AUX_LOGITS else {}
    return {"builder": f"torchvision.models:{name}", "kwargs": {"num_classes": num_classes, **extra}}


def describe_input(data: Dataset) -> dict[str, Any]:
    """What the held-out split gives the model: its shape and how its values are made."""
    if isinstance(data, builtin.InMemoryData):
        return {
            "size": list(data.x.shape[-2:]),
            "scale": data.scale,
            "mean": data.mean.flatten().tolist(),
            "std": data.std.flatten().tolist(),
            "values": "x * scale, then (x - mean) / std per channel",
        }
    if isinstance(data, text.TextWindows):
        return {
            "size": [data.context],
            "values": "class indices of characters (`classes`: the vocabulary, the last one any other character); "
            "the model gives the next character's logits at each position",
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
    if config.dataset == "stdlib_text":
        return [*text.VOCABULARY, "<other>"]
    if config.dataset == "imagefolder":
        root = Path(config.data_dir)
        classes, _ = find_samples(root / "train" if (root / "train").is_dir() else root)
        return classes
    return None
