"""ImageFolder decoded once: a uint8 cache at training resolution, augmented as tensor ops.

Not wired into the worker or the PS yet (the bench uses it: `python -m bench data`).

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

import torch
from torch.utils.data import Dataset

from app.imagefolder import CROP, MEAN, RESIZE, STD, to_rgb


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
    """(uint8 batch B x 3 x size x size, labels) for a list of indices; each file decoded once."""

    def __init__(self, samples: list[tuple[str, int]], size: int = RESIZE) -> None:
        self.samples, self.size = samples, size
        n = len(samples)
        storage = torch.UntypedStorage._new_shared(max(1, n * 3 * size * size))  # untouched until written
        self.images = torch.empty(0, dtype=torch.uint8).set_(storage)[: n * 3 * size * size].view(n, 3, size, size)
        self.filled = torch.zeros(n, dtype=torch.uint8).share_memory_()
        self.labels = torch.tensor([label for _, label in samples], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        for i in index[self.filled[index] == 0].tolist():
            self.images[i] = decode(self.samples[i][0], self.size)
            self.filled[i] = 1  # after the pixels: a reader never sees a half-written image as filled
        return self.images.index_select(0, index), self.labels[index]  # index_select: ~10x [index] for uint8


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
