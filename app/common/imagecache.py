"""ImageFolder decoded once: a uint8 cache at training resolution, augmented as tensor ops.

Used for `imagefolder` when --image_cache is on (train.image_cache); `python -m bench data` measures it.

- `CachedImageFolder` decodes each image once (Pillow, `to_rgb`, shorter side to
  `size`, the centre `size` x `size`) into one uint8 tensor in shared memory, filled
  on first access; the pages of images not yet decoded are never touched, so memory
  grows with what was read. DataLoader worker processes fill the same cache (forked
  or spawned: it is a shared torch storage). Indexed by a list of indices: one
  gather per batch (use it with a BatchSampler and batch_size=None).
- `augment` crops, flips and normalises a uint8 batch as tensor ops on whatever
  device the batch is on: only uint8 crosses /dev/shm and pinned memory, 4x
  less than float32, and the float work runs on the training device.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.data import Dataset

from app.common.imagefolder import CROP, MEAN, STD, to_rgb

RESIZE = round(CROP * 8 / 7)  # 256: the size ImageFolderData resizes a 224 crop's image to

log = logging.getLogger(__name__)


def decode(path: str, size: int = RESIZE) -> torch.Tensor:
    """The image at `path` as uint8 3 x size x size: shorter side to `size`, centre crop."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as img:
        img.draft("RGB", (size, size))  # JPEG: decode at a reduced scale when it is still >= size
        img = to_rgb(img)
        scale = size / min(img.size)
        w, h = max(size, round(img.width * scale)), max(size, round(img.height * scale))
        img = img.resize((w, h), Image.BILINEAR)
        left, top = (w - size) // 2, (h - size) // 2
        img = img.crop((left, top, left + size, top + size))
        array = np.asarray(img, dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


class CachedImageFolder(Dataset):
    """(uint8 batch B x 3 x size x size, labels) for a list of indices; each file decoded once.

    A file that does not decode is skipped as ImageFolderData skips it (one warning,
    counted in `skipped_images`): the next decodable image, and its label, stand in.
    `on_device` turns a batch, once on the training device, into the model's input."""

    def __init__(self, samples: list[tuple[str, int]], train: bool, crop: int = CROP) -> None:
        # Decoded at the size ImageFolderData resizes to (8/7 of the crop: 256 for 224).
        size = round(crop * 8 / 7)
        self.samples, self.train, self.size, self.crop = samples, train, size, crop
        n = len(samples)
        storage = torch.UntypedStorage._new_shared(max(1, n * 3 * size * size))  # untouched until written
        self.images = torch.empty(0, dtype=torch.uint8).set_(storage)[: n * 3 * size * size].view(n, 3, size, size)
        self.filled = torch.zeros(n, dtype=torch.uint8).share_memory_()
        self.bad = torch.zeros(n, dtype=torch.uint8).share_memory_()
        # A skipped file's slot takes its stand-in's label too.
        self.labels = torch.tensor([label for _, label in samples], dtype=torch.long).share_memory_()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def skipped_images(self) -> int:
        return int(self.bad.sum().item())

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        for i in index[self.filled[index] == 0].tolist():
            self._fill(i)
        return self.images.index_select(0, index), self.labels.index_select(0, index)  # ~10x [index] for uint8

    def _fill(self, i: int) -> None:
        n = len(self.samples)
        for step in range(n):
            j = (i + step) % n
            if self.bad[j]:
                continue
            if self.filled[j]:
                image = self.images[j].clone()
            else:
                try:
                    image = decode(self.samples[j][0], self.size)
                except FileNotFoundError:
                    raise  # the data dir vanished (app.common.data.batches)
                except Exception as error:  # noqa: BLE001 - Pillow raises many types for a bad file
                    self.bad[j] = 1
                    log.warning("skipping %s: cannot decode it (%s); the next image stands in for it "
                                "(%d skipped)", self.samples[j][0], type(error).__name__, self.skipped_images)
                    continue
            self.images[i] = image
            self.labels[i] = self.labels[j]
            self.filled[i] = 1  # last: a reader never sees a half-written image as filled
            return
        raise OSError(f"no image under the data dir decodes (the first: {self.samples[0][0]})")

    def on_device(self, batch: torch.Tensor) -> torch.Tensor:
        return augment(batch, self.train, self.crop)


def augment(batch: torch.Tensor, train: bool, crop: int = CROP,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 B x 3 x S x S -> normalised float32 B x 3 x crop x crop, on batch's device.
    Train: a random crop and a random horizontal flip per image; eval: the centre
    crop. Same statistics as ImageFolderData's transforms. The crops are uint8
    slice copies (fast on CPU and GPU alike); the one float pass normalises."""
    b, c, h, w = batch.shape
    device = batch.device
    if train:
        tops = torch.randint(0, h - crop + 1, (b,), generator=generator).tolist()
        lefts = torch.randint(0, w - crop + 1, (b,), generator=generator).tolist()
        flip = torch.rand(b, generator=generator) < 0.5
        x = torch.empty(b, c, crop, crop, dtype=torch.uint8, device=device)
        for i, (top, left) in enumerate(zip(tops, lefts)):
            x[i] = batch[i, :, top:top + crop, left:left + crop]
        if bool(flip.any()):
            chosen = flip.nonzero().flatten().to(device)
            x.index_copy_(0, chosen, x.index_select(0, chosen).flip(-1))
    else:
        top, left = (h - crop) // 2, (w - crop) // 2
        x = batch[:, :, top:top + crop, left:left + crop]
    scale = (1.0 / (255.0 * STD)).to(device)
    shift = (MEAN / STD).to(device)
    return x.float().mul_(scale).sub_(shift)
