"""Models by name: the built-in `cnn` and `char_transformer` (a small language model,
app/training/transformer.py), torchvision's classifiers when it imports, and
the user's own (`pkg.module:factory`, app/plugins.py).

Model code knows nothing about RPC or devices.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import nn

from app import plugins
from app.config import UsageError
from app.runtime.words import first_line
from app.training.transformer import CharTransformer

BUILT_IN = ("cnn", "char_transformer")
AUX_LOGITS = ("googlenet", "inception_v3")


class SmallCNN(nn.Module):
    """Two conv layers and two linear ones; any input size, any channel count."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class GrayToRGB(nn.Module):
    """Feeds one-channel images to a model built for three."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(-1, 3, -1, -1)


def _torchvision_models() -> ModuleType | None:
    try:
        return importlib.import_module("torchvision.models")
    except Exception:  # not installed, or a build that does not match this torch
        return None


def _why_no_torchvision() -> str:
    """Why torchvision does not import, in a few words (its error's first line)."""
    try:
        importlib.import_module("torchvision.models")
    except ModuleNotFoundError as error:
        if error.name == "torchvision":
            return "torchvision is not installed"
        return f"torchvision does not import ({type(error).__name__}: {error})"
    except Exception as error:  # noqa: BLE001 - any import failure is reported as it is
        return (
            f"torchvision does not import beside torch {torch.__version__} "
            f"({type(error).__name__}: {first_line(error)}); "
            "install torch and torchvision as a matching pair (images/torch-pair.txt)"
        )
    return "torchvision imports"


def available() -> list[str]:
    """Every model name this process can build."""
    tv = _torchvision_models()
    return list(BUILT_IN) + (sorted(tv.list_models(module=tv)) if tv else [])


def check(name: str) -> None:
    """Raise UsageError for a name that cannot be built here, listing what exists."""
    if name in BUILT_IN:
        return
    if plugins.is_entry_point(name):
        plugins.resolve("model", name)
        return
    tv = _torchvision_models()
    if tv is None:
        raise UsageError(
            f"unknown model {name!r}: {_why_no_torchvision()}, so the models that exist are: {', '.join(BUILT_IN)}"
        )
    if name not in tv.list_models(module=tv):
        raise UsageError(f"unknown model {name!r}; models that exist: {', '.join(available())}")


def build(name: str, channels: int, num_classes: int, seed: int) -> nn.Module:
    """A freshly initialised model (same seed, same weights); no weights are downloaded."""
    check(name)
    torch.manual_seed(seed)
    if name == "cnn":
        return SmallCNN(channels, num_classes)
    if name == "char_transformer":
        return CharTransformer(num_classes, channels)
    if plugins.is_entry_point(name):
        return plugins.build_model(name, channels, num_classes)
    tv = _torchvision_models()
    assert tv is not None  # check() above
    # Auxiliary heads change the output type in training mode; the loop wants logits.
    extra = {"aux_logits": False} if name in AUX_LOGITS else {}
    model = tv.get_model(name, weights=None, num_classes=num_classes, **extra)
    return nn.Sequential(GrayToRGB(), model) if channels == 1 else model
