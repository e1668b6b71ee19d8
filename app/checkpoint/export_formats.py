"""The exported model in formats that carry it without this project's code (app/export.py
writes them beside model.pt and model.json):

- `model.safetensors`: the same weights as model.pt (the state dict as the model's builder makes
  it) in safetensors' format, which holds tensors and nothing that runs when it is read:
  `safetensors.torch.load_file(path)`, then `load_state_dict`;
- `model.pt2`: a `torch.export` program of the model as its builder makes it (the input step
  of model.json, where there is one, is not in it), for any batch size; `torch.export.load(path)
  .module()(x)` runs it with torch alone.

A model that one cannot be made of is named with why (model.json's `not_exported`), and the
other files are written all the same.
"""

from __future__ import annotations

import io
import logging

import torch
from torch import nn

from app.data import datasets
from app.runtime.words import first_line

log = logging.getLogger("app.export")
EXAMPLES = 2  # torch.export treats a dimension of 1 as fixed: the example batch has two inputs
MAX_BATCH = 1 << 16


def examples(held_out: datasets.LabeledData, gray_to_rgb: bool) -> torch.Tensor:
    """`EXAMPLES` held-out inputs as the plain model takes them (one channel given as three
    where model.json's step does so)."""
    data = held_out.data
    count = min(EXAMPLES, len(data))  # type: ignore[arg-type]
    x = torch.stack([data[i][0] for i in range(count)] * (EXAMPLES // count))
    return x.expand(-1, 3, -1, -1) if gray_to_rgb else x


def weights(model: nn.Module) -> bytes:
    """model.safetensors' bytes of `model`'s state dict (each tensor its own contiguous copy:
    the format holds no tensor that shares another's memory, as tied weights do)."""
    from safetensors.torch import save

    return save({name: value.detach().cpu().contiguous().clone() for name, value in model.state_dict().items()})


def program(model: nn.Module, x: torch.Tensor) -> tuple[bytes | None, str]:
    """(model.pt2's bytes, '') of `model` traced on `x` with its first dimension (the batch)
    free; (None, why) when torch.export cannot export it."""
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    try:
        exported = torch.export.export(model.eval(), (x,), dynamic_shapes=({0: batch},))
        buffer = io.BytesIO()
        torch.export.save(exported, buffer)
    except Exception as error:  # noqa: BLE001 - what torch.export says of the user's model is the why
        return None, f"torch.export could not export it: {type(error).__name__}: {first_line(error)}"
    return buffer.getvalue(), ""
