"""`python -m bench data [--images N] [--batch B]`: images/s of one worker's data
pipeline on one core, on generated 224 px JPEGs:

- today: ImageFolderData (decode, resize, crop, flip, normalise per image, float32 out);
- first epoch: CachedImageFolder decoding into its uint8 cache, then `augment`;
- cached epoch: the cache only (the uint8 batches a loader hands over), and with
  `augment` on this CPU (on a GPU host it runs on the GPU instead);
- file cache: writing it (decode, one thread), then a cached epoch of a second
  dataset object that maps the file (a restarted worker; the file is in the page
  cache, as it is right after it was written).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def make_jpegs(root: Path, images: int, classes: int = 10, size: int = 224) -> None:
    """`images` JPEGs of size x size: smooth colour ramps plus noise (photo-like entropy)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 1, size, dtype=np.float32)
    for i in range(images):
        folder = root / f"c{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.uniform(0, 255, 3).astype(np.float32)
        pixels = base * ramp[None, :, None] + (255 - base) * ramp[:, None, None] + rng.normal(0, 12, (size, size, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i:06d}.jpg", quality=90)


def _rate(batches, count: int) -> float:
    start = time.perf_counter()
    seen = 0
    for x, _ in batches:
        seen += len(x)
    assert seen == count, (seen, count)
    return count / (time.perf_counter() - start)


def measure(root: Path, batch: int) -> dict[str, float]:
    import torch
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from app.data.augment import augment
    from app.data.imagecache import CachedImageFolder
    from app.data.imagefolder import ImageFolderData, find_samples

    torch.set_num_threads(1)  # one core per worker
    _, samples = find_samples(root)
    n = len(samples)
    today = DataLoader(ImageFolderData(samples, train=True), batch_size=batch, num_workers=0)
    cached = CachedImageFolder(samples, train=True)
    loader = DataLoader(cached, sampler=BatchSampler(SequentialSampler(range(n)), batch, False), batch_size=None)
    g = torch.Generator().manual_seed(0)
    rates = {"today": _rate(today, n)}
    rates["first epoch (decode + augment)"] = _rate(((augment(x, True, generator=g), y) for x, y in loader), n)
    rates["cached epoch (uint8 batches)"] = _rate(loader, n)
    rates["cached epoch + augment on CPU"] = _rate(((augment(x, True, generator=g), y) for x, y in loader), n)
    cache_dir = root.parent / (root.name + "-cache")
    start = time.perf_counter()
    CachedImageFolder(samples, train=True, cache_dir=cache_dir, threads=1)
    rates["file cache: write it (decode)"] = n / (time.perf_counter() - start)
    mapped = CachedImageFolder(samples, train=True, cache_dir=cache_dir)  # finds the file: decodes nothing
    from_file = DataLoader(mapped, sampler=BatchSampler(SequentialSampler(range(n)), batch, False), batch_size=None)
    rates["file cache: cached epoch (uint8)"] = _rate(from_file, n)
    return rates


def main(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="psc-data-"))
    try:
        make_jpegs(tmp, args.images)
        rates = measure(tmp, args.batch)
        print(f"data: {args.images} JPEGs of 224 px, batch {args.batch}, one core; images/s per worker:")
        for name, rate in rates.items():
            print(f"  {name:<32} {rate:>9,.0f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp.parent / (tmp.name + "-cache"), ignore_errors=True)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="images/s of one worker's ImageFolder pipeline: today, first and cached epoch")
    p.add_argument("--images", type=int, default=1024, help="generated JPEGs (default %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="batch size (default %(default)s)")
