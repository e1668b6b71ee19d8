"""Datasets read from local files, held-out splits, and per-worker shards."""

from __future__ import annotations

import gzip
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from app.config import UsageError
from app.data import builtin, datasets

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("size", "shards"), [(10, 3), (1437, 2), (5, 5), (7, 1)])
def test_shards_are_disjoint_and_cover_the_data(size, shards):
    for epoch in (0, 1):
        parts = []
        for shard in range(shards):
            sampler = datasets.ShardSampler(size, shards, shard, seed=3)
            sampler.set_epoch(epoch)
            parts.append(list(sampler))
            assert len(parts[-1]) == len(sampler)
        flat = [i for part in parts for i in part]
        assert sorted(flat) == list(range(size))  # covered exactly once
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_set_epoch_reshuffles_the_same_shard_size():
    sampler = datasets.ShardSampler(100, 2, 1, seed=0)
    sampler.set_epoch(1)
    first = list(sampler)
    sampler.set_epoch(2)
    second = list(sampler)
    assert first != second and len(first) == len(second) == 50
    sampler.set_epoch(1)
    assert list(sampler) == first  # same epoch, same order


def test_digits_train_and_held_out_split_the_dataset():
    train = datasets.load("digits", "", "train", seed=0)
    test = datasets.load("digits", "", "test", seed=5)
    assert len(train.data) + len(test.data) == 1797
    assert len(test.data) == round(1797 * builtin.HELD_OUT)
    assert (train.channels, train.num_classes) == (1, 10)
    x, y = test.data[[0, 1, 2]]
    assert x.shape == (3, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64


def test_digits_are_scikit_learns_load_digits_value_for_value():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels, labels = builtin.digits_table()
    assert pixels.dtype == bunch.data.dtype and labels.dtype == bunch.target.dtype
    assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target)


def test_loading_digits_does_not_import_scikit_learn():
    code = (
        "import sys; from app.data import datasets; d = datasets.load('digits', '', 'train', seed=0); "
        "print(len(d.data), sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy', 'pandas')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.split() == [str(1797 - round(1797 * builtin.HELD_OUT)), "[]"]


def test_digits_without_scikit_learn_is_one_line_naming_it(monkeypatch):
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"^dataset digits: its file ships inside scikit-learn, which is not installed"):
        datasets.load("digits", "", "train", seed=0)


def test_in_memory_loader_batches_the_shard():
    train = datasets.load("synthetic", "", "train", seed=0)
    sampler = datasets.ShardSampler(len(train.data), 2, 0)
    loader = datasets.train_loader(train.data, sampler, 100, loader_workers=0, pin_memory=False)
    sizes = [len(y) for _, y in loader]
    assert sizes == [100] * (len(sampler) // 100)  # the short last batch is dropped


def _write_png(path, color, size=(12, 10)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def test_imagefolder_reads_class_folders_like_torchvision(tmp_path):
    for i in range(6):
        _write_png(tmp_path / "n02_cat" / f"{i}.png", (200, 0, 0))
        _write_png(tmp_path / "n01_dog" / f"{i}.PNG", (0, 0, 200), size=(9, 14))
    (tmp_path / "n01_dog" / "notes.txt").write_text("not an image")

    classes, samples = datasets.find_samples(tmp_path)
    assert classes == ["n01_dog", "n02_cat"]
    assert len(samples) == 12 and all(p.lower().endswith(".png") for p, _ in samples)

    train = datasets.load("imagefolder", str(tmp_path), "train", seed=0)
    test = datasets.load("imagefolder", str(tmp_path), "test", seed=0)
    assert (train.num_classes, train.channels) == (2, 3)
    assert len(train.data) + len(test.data) == 12 and len(test.data) >= 1
    assert not {p for p, _ in train.data.samples} & {p for p, _ in test.data.samples}
    x, label = test.data[0]
    assert x.shape == (3, 224, 224)
    red = x[0].mean() > x[2].mean()
    assert red == (label == 1)  # n02_cat is class 1, red


def test_imagefolder_without_images_names_the_path(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.txt").write_text("x")
    with pytest.raises(UsageError, match=f"no class folders with images .*: {tmp_path}$"):
        datasets.load("imagefolder", str(tmp_path), "train", seed=0)


def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def test_mnist_reads_torchvision_raw_files(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.arange(5 * 28 * 28).reshape(5, 28, 28) % 256
    (raw / "train-images-idx3-ubyte").write_bytes(_idx(images))
    (raw / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx(np.array([3, 1, 4, 1, 5]))))
    train = datasets.load("mnist", str(tmp_path), "train", seed=0)
    x, y = train.data[[0, 4]]
    assert y.tolist() == [3, 5] and x.shape == (2, 1, 28, 28)
    expected = (torch.tensor(images[4], dtype=torch.float32) / 255 - 0.1307) / 0.3081
    assert torch.allclose(x[1, 0], expected)
    with pytest.raises(UsageError, match="no MNIST file"):
        datasets.load("mnist", str(tmp_path), "test", seed=0)


def test_cifar10_reads_python_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batch = {b"data": np.full((4, 3072), 255, dtype=np.uint8), b"labels": [0, 9, 2, 2]}
    (folder / "test_batch").write_bytes(pickle.dumps(batch))
    test = datasets.load("cifar10", str(tmp_path), "test", seed=0)
    x, y = test.data[[1]]
    assert y.tolist() == [9] and x.shape == (1, 3, 32, 32)
    assert torch.allclose(x[0, 0], torch.full((32, 32), (1 - 0.4914) / 0.2470))


def test_missing_and_empty_data_dir(tmp_path):
    with pytest.raises(UsageError, match=f"^data dir not found: {tmp_path}/nope$"):
        datasets.check_data_dir("cifar10", str(tmp_path / "nope"))
    with pytest.raises(UsageError, match=f"^data dir is empty: {tmp_path}$"):
        datasets.check_data_dir("imagefolder", str(tmp_path))
    datasets.check_data_dir("digits", str(tmp_path / "nope"))  # digits reads no files
