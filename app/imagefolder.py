"""An ImageFolder-compatible dataset (class folders of images) decoded with Pillow.

Same class order and sample order as torchvision.datasets.ImageFolder.
Transforms, for a crop size S (224 by default): shorter side to 8/7 S (256),
then a random S crop and a horizontal flip for training, the centre crop for
evaluation, and ImageNet normalisation.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from app.config import UsageError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
CROP = 224
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def find_samples(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """(class names, [(path, class index)]), both sorted as torchvision sorts them."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    samples: list[tuple[str, int]] = []
    kept: list[str] = []
    for name in classes:
        files = sorted(
            os.path.join(dirpath, f)
            for dirpath, _, filenames in os.walk(root / name, followlinks=True)
            for f in filenames if f.lower().endswith(IMG_EXTENSIONS)
        )
        if files:
            samples.extend((path, len(kept)) for path in files)
            kept.append(name)
    if not samples:
        raise UsageError(f"data dir has no class folders with images ({', '.join(IMG_EXTENSIONS)}): {root}")
    return kept, samples


class ImageFolderData(Dataset):
    """(image tensor 3xSxS, label) per sample; random crop and flip when `train`."""

    def __init__(self, samples: list[tuple[str, int]], train: bool, crop: int = CROP) -> None:
        self.samples = samples
        self.train = train
        self.crop, self.resize = crop, round(crop * 8 / 7)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image  # imported here: only this dataset needs Pillow

        path, label = self.samples[index]
        with Image.open(path) as img:
            img = img.convert("RGB")
            crop = self.crop
            scale = self.resize / min(img.size)
            size = (max(crop, round(img.width * scale)), max(crop, round(img.height * scale)))
            img = img.resize(size, Image.BILINEAR)
            if self.train:
                left = int(torch.randint(0, img.width - crop + 1, ()).item())
                top = int(torch.randint(0, img.height - crop + 1, ()).item())
            else:
                left, top = (img.width - crop) // 2, (img.height - crop) // 2
            img = img.crop((left, top, left + crop, top + crop))
            if self.train and torch.rand(()).item() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
            array = np.asarray(img, dtype=np.uint8)
        x = torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255)
        return (x - MEAN) / STD, label
