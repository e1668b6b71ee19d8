"""The uint8 image cache and the tensor-op augmentation (app/data/imagecache.py, augment.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from app.data.augment import augment
from app.data.imagecache import CachedImageFolder
from app.data.imagefolder import ImageFolderData, find_samples
from app.training.metrics import read

from app_testkit import run_cluster


def _tree(root: Path) -> list[tuple[str, int]]:
    g = torch.Generator().manual_seed(0)
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(5):
            pixels = torch.randint(0, 256, (300, 260, 3), generator=g, dtype=torch.uint8).numpy()
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i}.png")
    return find_samples(root)[1]


def test_eval_batches_equal_imagefolder_eval_samples(tmp_path):
    samples = _tree(tmp_path)
    reference = ImageFolderData(samples, train=False)
    cached = CachedImageFolder(samples, train=False)
    x, y = cached[[0, 3, 7]]
    assert x.dtype == torch.uint8 and x.shape == (3, 3, 256, 256)
    out = augment(x, train=False)
    for row, i in enumerate((0, 3, 7)):
        want, label = reference[i]
        assert y[row] == label
        assert (out[row] - want).abs().mean() < 0.05  # PNG: same pixels up to resize rounding


def test_train_crops_are_windows_of_the_cached_image_flipped_or_not(tmp_path):
    batch = torch.randint(0, 256, (16, 3, 40, 40), dtype=torch.uint8)
    out = augment(batch, train=True, crop=24, generator=torch.Generator().manual_seed(1))
    from app.data.imagefolder import MEAN, STD

    back = ((out * STD + MEAN) * 255).round().to(torch.uint8)
    flipped = 0
    for i in range(16):
        windows = batch[i].unfold(1, 24, 1).unfold(2, 24, 1).permute(1, 2, 0, 3, 4)  # 17 x 17 x 3 x 24 x 24
        plain = (windows == back[i]).flatten(2).all(-1).any()
        mirror = (windows == back[i].flip(-1)).flatten(2).all(-1).any()
        assert plain or mirror
        flipped += bool(mirror and not plain)
    assert 0 < flipped < 16


def test_the_batched_crops_a_gpu_takes_are_the_per_image_copies_pixel_for_pixel():
    batch = torch.randint(0, 256, (32, 3, 40, 36), dtype=torch.uint8)
    copies = augment(batch, train=True, crop=24, generator=torch.Generator().manual_seed(7), gather=False)
    gathered = augment(batch, train=True, crop=24, generator=torch.Generator().manual_seed(7), gather=True)
    assert torch.equal(copies, gathered)


def test_each_file_is_decoded_once_and_loader_processes_fill_one_cache(tmp_path):
    samples = _tree(tmp_path)
    cached = CachedImageFolder(samples, train=True)
    loader = DataLoader(
        cached, sampler=BatchSampler(SequentialSampler(range(len(samples))), 4, False), batch_size=None, num_workers=2
    )
    first = torch.cat([x for x, _ in loader])
    assert int(cached.filled.sum()) == len(samples)  # filled by the loader processes, seen here
    for path, _ in samples:
        Path(path).unlink()  # a second epoch reads the cache only
    second = torch.cat([x for x, _ in loader])
    assert torch.equal(first, second)


def test_an_undecodable_file_gets_a_stand_in_and_its_label(tmp_path):
    samples = _tree(tmp_path)
    bad = samples[4][0]
    Path(bad).write_bytes(b"not a png")
    cached = CachedImageFolder(samples, train=False)
    x, y = cached[list(range(len(samples)))]
    assert cached.skipped_images == 1
    assert torch.equal(x[4], x[5]) and y[4] == y[5] == samples[5][1]


@pytest.mark.slow
def test_a_cluster_trains_from_the_cache(tmp_path):
    root = tmp_path / "data"
    for c, colour in (("a", (250, 0, 0)), ("b", (0, 0, 250))):
        (root / c).mkdir(parents=True)
        for i in range(24):
            Image.new("RGB", (64, 48), colour).save(root / c / f"{i}.png")
    (root / "a" / "00-bad.png").write_bytes(b"")
    args = [
        "--model",
        "cnn",
        "--dataset",
        "imagefolder",
        "--data_dir",
        str(root),
        "--image_cache",
        "true",
        "--batch_size",
        "8",
        "--lr",
        "0.05",
        "--num_epochs",
        "3",
        "--loader_workers",
        "1",
        "--rpc_timeout",
        "30",
    ]
    procs = run_cluster(tmp_path, workers=2, args=args, timeout=240)
    assert {p.name: p.returncode for p in procs.values()} == {"ps": 0, "worker1": 0, "worker2": 0}, procs["ps"].stderr[
        -3000:
    ]
    end = read(tmp_path / "metrics" / "ps.jsonl")[-1]
    assert end["event"] == "end" and end["accuracy"] >= 0.9
    ends = [read(tmp_path / "metrics" / f"worker{r}.jsonl")[-1] for r in (1, 2)]
    assert end["skipped_images"] + sum(e["skipped_images"] for e in ends) >= 1
