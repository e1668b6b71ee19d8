"""The trained model as an MLflow model (`mlflow.pytorch.save_model`): the directory MLflow's
`log_model` logs, with a signature (the input's and the output's dtypes and shapes, the batch
free) and an input example of two held-out samples, so `mlflow.pytorch.load_model("runs:/<run
id>/model")` loads it and the model registry takes it. The PS logs it with its run
(app/training/tracking.py); its files go as bytes, the tracker's thread sends them.

The model is the plain one its builder makes (app/checkpoint/export_files.py `plain_model`),
pickled by MLflow as it pickles every PyTorch model: loading it imports its class (the app's
built-in models, torchvision's, or your own `code`).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch
from torch import nn

from app.checkpoint import export_files, export_formats
from app.config import Config
from app.data import datasets
from app.runtime.words import first_line
from app.training import models

log = logging.getLogger("app.export")


def files(model: nn.Module, x: torch.Tensor) -> dict[str, bytes]:
    """The MLflow model directory of `model`, its signature inferred from `x` and model(x), `x` its
    input example: relative path -> bytes."""
    import mlflow.pytorch
    from mlflow.models import infer_signature

    model = model.eval()
    with torch.no_grad():
        y = model(x)
    signature = infer_signature(x.numpy(), y.numpy())
    requirements = [f"torch=={torch.__version__.split('+')[0]}"]  # no inference: it would load the model again
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory, "model")
        mlflow.pytorch.save_model(
            model, str(path), signature=signature, input_example=x.numpy(), pip_requirements=requirements
        )
        return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def of_run(config: Config, trained: dict[str, torch.Tensor], held_out: datasets.LabeledData) -> dict[str, bytes]:
    """`files` of the run's trained model (its state dict as the app built it) on two held-out
    samples; {} (and one warning saying why) where MLflow cannot save it."""
    try:
        built = models.build(config.model, held_out.channels, held_out.num_classes, config.seed)
        gray_to_rgb = isinstance(built, nn.Sequential) and isinstance(built[0], models.GrayToRGB)
        x = export_formats.examples(held_out, gray_to_rgb=gray_to_rgb)
        return files(export_files.plain_model(config, trained, held_out), x)
    except Exception as error:  # noqa: BLE001 - the run is logged without it; the export files still go
        log.warning("MLflow: the model is logged as files only (mlflow.pytorch cannot save it: %s)", first_line(error))
        return {}
