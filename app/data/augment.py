"""A uint8 batch of the image cache made the model's input as tensor ops, on whatever device
the batch is on: only uint8 crosses /dev/shm and pinned memory, 4x less than float32, and
the float work runs on the training device. On a GPU nothing in it waits for the device: the
crops' random numbers are drawn there (its own generator) and the normalisation's constants
are kept there, so no small tensor is copied from pageable host memory (such a copy waits for
everything queued on the stream before it)."""

from __future__ import annotations

import torch

from app.data.imagefolder import CROP, MEAN, STD

_NORMALISE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (scale, shift), made once


def normalisation(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 / (255 std), mean / std) per channel on `device`, copied there once per process."""
    if device not in _NORMALISE:
        _NORMALISE[device] = ((1.0 / (255.0 * STD)).to(device), (MEAN / STD).to(device))
    return _NORMALISE[device]


def augment(
    batch: torch.Tensor,
    train: bool,
    crop: int = CROP,
    generator: torch.Generator | None = None,
    gather: bool | None = None,
) -> torch.Tensor:
    """uint8 B x 3 x S x S -> normalised float32 B x 3 x crop x crop, on batch's device.
    Train: a random crop and a random horizontal flip per image; eval: the centre
    crop. Same statistics as ImageFolderData's transforms. The crops are uint8: on
    the CPU one slice copy per image (memcpy speed), on a GPU (`gather`, by default
    wherever the batch is not on the CPU) one indexing op for the whole batch, crops
    and flips at once, where a copy per image would cost a kernel launch each; the
    two give the same pixels. The one float pass normalises. The random numbers come from
    `generator`, on its device, or else from the batch's device's default generator."""
    b, c, h, w = batch.shape
    device = batch.device
    if train:
        where = generator.device if generator is not None else device
        tops = torch.randint(0, h - crop + 1, (b,), generator=generator, device=where)
        lefts = torch.randint(0, w - crop + 1, (b,), generator=generator, device=where)
        flip = torch.rand(b, generator=generator, device=where) < 0.5
        if device.type != "cpu" if gather is None else gather:
            x = _gathered_crops(batch, tops, lefts, flip, crop)
        else:
            x = torch.empty(b, c, crop, crop, dtype=torch.uint8, device=device)
            for i, (top, left) in enumerate(zip(tops.tolist(), lefts.tolist())):
                x[i] = batch[i, :, top : top + crop, left : left + crop]
            if bool(flip.any()):
                chosen = flip.nonzero().flatten().to(device)
                x.index_copy_(0, chosen, x.index_select(0, chosen).flip(-1))
    else:
        top, left = (h - crop) // 2, (w - crop) // 2
        x = batch[:, :, top : top + crop, left : left + crop]
    scale, shift = normalisation(device)
    return x.float().mul_(scale).sub_(shift)


def _gathered_crops(
    batch: torch.Tensor, tops: torch.Tensor, lefts: torch.Tensor, flip: torch.Tensor, crop: int
) -> torch.Tensor:
    """Every image's crop window (mirrored where `flip`) in one advanced-indexing op on the
    batch's device: rows top..top+crop-1, columns left.. or, flipped, left+crop-1 down to left."""
    device = batch.device
    step = torch.arange(crop, device=device)
    tops, lefts, flip = tops.to(device), lefts.to(device), flip.to(device)
    rows = tops[:, None] + step  # B x crop
    cols = lefts[:, None] + torch.where(flip[:, None], crop - 1 - step, step)  # B x crop
    images = torch.arange(batch.shape[0], device=device)[:, None, None, None]
    channels = torch.arange(batch.shape[1], device=device)[None, :, None, None]
    return batch[images, channels, rows[:, None, :, None], cols[:, None, None, :]]
