"""The example's dataset: `train.dataset: mynet.data:digits_npz`, read from
<data_dir>/digits.npz (written by examples/custom/make_data.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

FILE = "digits.npz"
MEAN, STD = 0.3, 0.4  # of the pixels scaled to 0..1


def digits_npz(root: str, train: bool, seed: int) -> tuple[Dataset, int, int]:
    """The dataset factory ps-compose calls: (Dataset of (x, y), channels, num_classes).

    `train=False` is the held-out split the PS evaluates on; `seed` is unused (the
    split is fixed in the file)."""
    split = "train" if train else "test"
    with np.load(Path(root) / FILE) as f:
        x, y = f[f"x_{split}"], f[f"y_{split}"]
    images = (torch.from_numpy(x).float().div_(16).unsqueeze(1) - MEAN) / STD  # N x 1 x 8 x 8
    return TensorDataset(images, torch.from_numpy(y).long()), 1, 10
