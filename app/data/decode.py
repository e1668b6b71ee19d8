"""An image file decoded once for the image cache: uint8 3 x size x size, the shorter side
resized to `size` and the centre square kept (app.data.imagecache, app.data.store)."""

from __future__ import annotations

import logging

import torch

from app.data.imagefolder import CROP, to_rgb

RESIZE = round(CROP * 8 / 7)  # 256: the size ImageFolderData resizes a 224 crop's image to

log = logging.getLogger("app.data.imagecache")  # the image cache's one log, whichever part writes


def decode(path: str, size: int = RESIZE) -> torch.Tensor:
    """The image at `path` as uint8 3 x size x size: shorter side to `size`, centre crop."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as img:
        img.draft("RGB", (size, size))  # JPEG: decode at a reduced scale when it is still >= size
        img = to_rgb(img)
        scale = size / min(img.size)
        w, h = max(size, round(img.width * scale)), max(size, round(img.height * scale))
        img = img.resize((w, h), Image.Resampling.BILINEAR)
        left, top = (w - size) // 2, (h - size) // 2
        img = img.crop((left, top, left + size, top + size))
        array = np.asarray(img, dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


def decoded_size(crop: int) -> int:
    """The side images are decoded at for crop side `crop`: 8/7 of it (256 for 224)."""
    return round(crop * 8 / 7)


def decode_or_error(path: str, size: int) -> torch.Tensor | Exception:
    """The decoded image, or why it does not decode."""
    try:
        return decode(path, size)
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - Pillow raises many types for a bad file
        return error


def warn_bad(path: str, error: Exception, skipped: int) -> None:
    log.warning(
        "skipping %s: cannot decode it (%s); the next image stands in for it (%d skipped)",
        path,
        type(error).__name__,
        skipped,
    )
