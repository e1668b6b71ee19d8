"""An ImageFolder-compatible dataset (class folders of images) decoded with Pillow.

Same class order and sample order as torchvision.datasets.ImageFolder, without
needing torchvision: classes sorted, then each class's directories in sorted
path order (as torchvision sorts os.walk's tuples) and the files of each
directory sorted. Transforms, for a crop size S (224 by default): shorter side
to 8/7 S (256), then a random S crop and a horizontal flip for training, the
centre crop for evaluation, and ImageNet normalisation.

Real folders: grayscale, palette (with or without transparency), RGBA and CMYK
images become RGB (transparent pixels over white). A file Pillow cannot decode
(corrupt, truncated, not an image) is skipped: it is logged once, counted, and
the next decodable sample of the dataset stands in for it, so every index
still yields a sample. The record of bad files lives in a shared-memory tensor
(one flag per sample), so DataLoader worker processes, forked or spawned, mark
the same flags the training process reads for its `skipped_images` metric.
A file that disappears is not skipped: that is the data dir vanishing
(FileNotFoundError, app.data.datasets.DataUnavailable).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from app.config import UsageError
from app.runtime.words import first_line

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
CROP = 224
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
BACKGROUND = (255, 255, 255)  # under transparent pixels

log = logging.getLogger(__name__)


class NothingDecodes(UsageError):
    """No image of a split decodes: bad input, one line (exit 2). Raised in a DataLoader
    process, it comes back as this type with that process's traceback as its text: the last
    line is the message."""

    def __init__(self, text: str) -> None:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else text
        super().__init__(last.split(f"{NothingDecodes.__name__}: ", 1)[-1])

    @classmethod
    def of(cls, samples: list[tuple[str, int]]) -> NothingDecodes:
        return cls(
            f"data dir: none of the {len(samples)} images of this split decodes (the first: {samples[0][0]}); "
            "put images Pillow reads there"
        )


def _scan(directory: str, found: list[tuple[str, list[str]]], above: frozenset[tuple[int, int]] = frozenset()) -> None:
    """Append (dirpath, its image file names sorted) for `directory` and every directory
    below it (symlinks followed, as os.walk(followlinks=True)). No stat per file: the
    dirent type tells directories from the rest, and the rest counts as files, as in os.walk.
    A link back to a directory it is in (`above`: theirs, device and inode) is a UsageError
    naming it, where os.walk would follow it until the path is too long."""
    here = os.stat(directory)
    mine = (here.st_dev, here.st_ino)
    if mine in above:
        raise UsageError(
            f"data dir: {directory} leads back to {os.path.realpath(directory)}, a folder it is in "
            "(a symlink loop); remove the link"
        )
    files: list[str] = []
    subdirs: list[str] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir():
                subdirs.append(entry.path)
            elif entry.name.lower().endswith(IMG_EXTENSIONS):
                files.append(entry.name)
    found.append((directory, sorted(files)))
    for sub in subdirs:
        _scan(sub, found, above | {mine})


def class_files(class_dir: str) -> list[str]:
    """The image paths of one class folder, in torchvision's order."""
    found: list[tuple[str, list[str]]] = []
    _scan(class_dir, found)
    found.sort(key=lambda item: item[0])  # torchvision: sorted(os.walk(...)), i.e. by dirpath
    return [os.path.join(dirpath, name) for dirpath, names in found for name in names]


def find_samples(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """(class names, [(path, class index)]), both sorted as torchvision sorts them.
    UsageError (one line) when there is no class folder, a class folder has no image, or
    there is only one class (nothing to classify: it would train to an accuracy of 1.0)."""
    with os.scandir(root) as entries:
        classes = sorted(entry.name for entry in entries if entry.is_dir())
    files = [class_files(os.path.join(root, name)) for name in classes]
    if not any(files):
        raise UsageError(f"data dir has no class folders with images ({', '.join(IMG_EXTENSIONS)}): {root}")
    empty = next((name for name, found in zip(classes, files) if not found), None)
    if empty is not None:
        raise UsageError(
            f"data dir: class folder {empty!r} has no images ({', '.join(IMG_EXTENSIONS)}); "
            f"put images in it or remove it: {root}"
        )
    if len(classes) < 2:
        raise UsageError(
            f"data dir: one class folder ({classes[0]!r}); a classifier needs at least two classes, "
            f"each in its own folder of images: {root}"
        )
    samples = [(path, index) for index, found in enumerate(files) for path in found]
    return classes, samples


def to_rgb(img):  # PIL.Image.Image -> PIL.Image.Image
    """Any Pillow mode as RGB: alpha (RGBA, LA, PA, a palette or grayscale image with a
    transparent colour) composited over BACKGROUND; CMYK, grayscale, palette, 16-bit
    converted by Pillow."""
    from PIL import Image

    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grayscale: scale to 8 bits first
        array = np.asarray(img, dtype=np.float64)
        peak = 65535.0 if img.mode.startswith("I;16") else max(float(array.max()), 1.0)
        return Image.fromarray(np.clip(array * 255.0 / peak, 0, 255).astype(np.uint8), "L").convert("RGB")
    return img.convert("RGB")


class ImageFolderData(Dataset):
    """(image tensor 3xSxS, label) per sample; random crop and flip when `train`."""

    def __init__(self, samples: list[tuple[str, int]], train: bool, crop: int = CROP) -> None:
        self.samples = samples
        self.train = train
        self.crop, self.resize = crop, round(crop * 8 / 7)
        # One flag per sample, 1 once its file failed to decode; in shared memory, so
        # DataLoader worker processes set the flags this process counts.
        self.bad = torch.zeros(len(samples), dtype=torch.uint8).share_memory_()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def skipped_images(self) -> int:
        """How many distinct files failed to decode so far (in any loader process)."""
        return int(self.bad.sum().item())

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample `index`, or, when its file does not decode, the next one that does."""
        for step in range(len(self.samples)):
            i = (index + step) % len(self.samples)
            if self.bad[i]:
                continue
            try:
                return self._load(i)
            except FileNotFoundError:
                raise  # the data dir vanished: not a bad file (app.data.datasets.batches)
            except Exception as error:  # noqa: BLE001 - Pillow raises many types for a bad file
                self._mark_bad(i, error)
        raise NothingDecodes.of(self.samples)

    def _mark_bad(self, i: int, error: Exception) -> None:
        # A sample is fetched by one loader process at a time, so set-once needs no lock.
        self.bad[i] = 1
        log.warning(
            "skipping %s: cannot decode it (%s: %s); the next image stands in for it (%d skipped)",
            self.samples[i][0],
            type(error).__name__,
            first_line(error),
            self.skipped_images,
        )

    def _load(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image  # imported here: only this dataset needs Pillow

        path, label = self.samples[index]
        with Image.open(path) as img:
            return prepare(img, self.crop, self.train), label


def prepare(img: Any, crop: int, train: bool) -> torch.Tensor:
    """A Pillow image as the model's input: RGB, the shorter side to 8/7 of `crop`, a random
    `crop` square and a horizontal flip half the time when `train`, else the centre square;
    ImageNet normalisation (imagefolder's, and webdataset's: app/data/tarshards.py)."""
    from PIL import Image

    img = to_rgb(img)
    scale = round(crop * 8 / 7) / min(img.size)
    size = (max(crop, round(img.width * scale)), max(crop, round(img.height * scale)))
    img = img.resize(size, Image.Resampling.BILINEAR)
    if train:
        left = int(torch.randint(0, img.width - crop + 1, ()).item())
        top = int(torch.randint(0, img.height - crop + 1, ()).item())
    else:
        left, top = (img.width - crop) // 2, (img.height - crop) // 2
    img = img.crop((left, top, left + crop, top + crop))
    if train and torch.rand(()).item() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    array = np.asarray(img, dtype=np.uint8)
    x = torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255)
    return (x - MEAN) / STD
