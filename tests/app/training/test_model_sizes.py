"""app/model_sizes.py, the torch-free table the orchestrator sizes the exchange's shared memory
from, against torchvision's models themselves."""

from __future__ import annotations

import torch

from app.model_sizes import STATE_FLOATS
from app.training import models
from app.training.flat import state_size


def test_every_model_in_the_table_is_one_torchvision_has():
    assert set(STATE_FLOATS) <= set(models.available())
    assert {"resnet18", "resnet50", "vit_b_16", "efficientnet_b0", "mobilenet_v3_large"} <= set(STATE_FLOATS)


def test_the_table_holds_each_models_state_size_at_1000_classes():
    """Built on the meta device (shapes, no memory); the few whose initialisation needs real
    values (the regnets) are built on the CPU when they are small."""
    checked = 0
    for name, floats in STATE_FLOATS.items():
        try:
            with torch.device("meta"):
                model = models.build(name, 3, 1000, 0)
        except (NotImplementedError, RuntimeError):
            if floats > 20_000_000:
                continue
            model = models.build(name, 3, 1000, 0)
        assert state_size(model) == floats, name
        checked += 1
    assert checked >= len(STATE_FLOATS) - 6
