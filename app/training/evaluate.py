"""The held-out evaluation: accuracy and mean loss of a model (or a state vector) on the test split."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from app.data import datasets
from app.training.flat import FlatModel


@torch.no_grad()
def held_out_accuracy(
    model: nn.Module, loader: torch.utils.data.DataLoader, device: torch.device
) -> tuple[float, float]:
    """Accuracy and mean loss of `model` on the held-out split (in eval mode; its mode is restored)."""
    was_training = model.training
    model.eval()
    correct, total, loss = 0, 0, 0.0
    try:
        for x, y in loader:
            x, y = datasets.to_device(x, loader.dataset, device), y.to(device, non_blocking=True)
            logits = model(x)
            loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(1) == y).sum().item())
            total += len(y)
    finally:
        model.train(was_training)
    return correct / total, loss / total


class Evaluator:
    """Accuracy and loss of a state vector on the held-out split, on its own model copy."""

    def __init__(
        self, build: Callable[[], nn.Module], loader: torch.utils.data.DataLoader, device: torch.device
    ) -> None:
        self.model = build().to(device).eval()
        self.flat = FlatModel(self.model, with_grads=False)
        self.loader, self.device = loader, device

    def __call__(self, vector: torch.Tensor) -> tuple[float, float]:
        self.flat.load(vector)
        return held_out_accuracy(self.model, self.loader, self.device)

    def state_dict(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's state dict (on CPU) holding `vector`."""
        self.flat.load(vector)
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
