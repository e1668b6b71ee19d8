"""The built-in datasets held in one tensor: mnist and cifar10 read from the files torchvision
would have saved, digits from the file scikit-learn ships (read without importing it),
synthetic generated from the seed; and the fixed held-out split of those that have none of
their own. Nothing is downloaded. `read` gives one split of one of them.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from app.config import UsageError

HELD_OUT = 0.2  # of digits and synthetic; imagefolder holds out 10%
SPLIT_SEED = 0

Split = tuple[Dataset, int, int]  # one split's samples, their channels and their number of classes


class InMemoryData(Dataset):
    """Samples in one tensor, normalised per batch; indexed by a list of indices."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, mean: Sequence[float], std: Sequence[float], scale: float = 1.0
    ) -> None:
        self.x, self.y = x, y.long()
        self.scale = scale
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.x[index].float().mul_(self.scale)
        return (batch - self.mean) / self.std, self.y[index]


def held_out_mask(n: int, fraction: float) -> torch.Tensor:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[perm[: max(1, round(n * fraction))]] = True
    return mask


DIGITS_FILE = ("datasets", "data", "digits.csv.gz")  # in the scikit-learn package


def digits_table() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, as its `load_digits()` gives them: (1797 x 64 pixel values 0..16
    as float64, 1797 labels as int64), read from the file the package ships without importing
    it: importing scikit-learn (scipy, pandas) costs each process ~2.5 CPU-seconds, as much as
    torch's own import, and every process of a digits run loads them."""
    spec = importlib.util.find_spec("sklearn")  # a top-level package's spec: nothing of it runs
    if spec is None:
        raise UsageError("dataset digits: its file ships inside scikit-learn, which is not installed")
    found = [Path(folder, *DIGITS_FILE) for folder in spec.submodule_search_locations or []]
    path = next((p for p in found if p.is_file()), None)
    if path is None:
        raise UsageError(f"dataset digits: scikit-learn ({spec.origin}) has no {'/'.join(DIGITS_FILE)}")
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int, copy=False)


def digits(root: Path, train: bool, seed: int) -> Split:
    pixels, labels = digits_table()
    x = torch.from_numpy(pixels.astype(np.float32)).view(-1, 1, 8, 8)
    y = torch.from_numpy(labels)
    keep = held_out_mask(len(y), HELD_OUT) ^ train
    return InMemoryData(x[keep], y[keep], [0.3], [0.4], scale=1 / 16), 1, 10


def synthetic(root: Path, train: bool, seed: int) -> Split:
    """10 classes of 3x32x32 images: a fixed random pattern per class plus noise."""
    g = torch.Generator().manual_seed(seed)
    n = 5120
    patterns = torch.randn(10, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    x = patterns[y] + torch.randn(n, 3, 32, 32, generator=g)
    keep = held_out_mask(n, HELD_OUT) ^ train
    return InMemoryData(x[keep], y[keep], [0.0] * 3, [1.4] * 3), 3, 10


def _find(root: Path, names: Sequence[str], what: str) -> Path:
    for folder in (root, root / "raw", root / "MNIST" / "raw", root / "cifar-10-batches-py"):
        for name in names:
            if (folder / name).is_file():
                return folder / name
    raise UsageError(f"no {what} file ({' or '.join(names)}) under {root}")


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def mnist(root: Path, train: bool, seed: int) -> Split:
    prefix = "train" if train else "t10k"
    images = _read_idx(_find(root, [f"{prefix}-images-idx3-ubyte", f"{prefix}-images-idx3-ubyte.gz"], "MNIST"))
    labels = _read_idx(_find(root, [f"{prefix}-labels-idx1-ubyte", f"{prefix}-labels-idx1-ubyte.gz"], "MNIST"))
    x = torch.from_numpy(images.copy()).unsqueeze(1)
    return InMemoryData(x, torch.from_numpy(labels.astype(np.int64)), [0.1307], [0.3081], 1 / 255), 1, 10


def _numpy_module(name: str) -> Any:
    """numpy's own module `name`: numpy._core.NAME (numpy.core.NAME on numpy 1.x)."""
    try:
        return importlib.import_module(f"numpy._core.{name}")
    except ImportError:
        return importlib.import_module(f"numpy.core.{name}")


_np_multiarray, _np_numeric = _numpy_module("multiarray"), _numpy_module("numeric")

# The globals a CIFAR-10 python batch may name: numpy's array reconstruction as numpy 1 (the
# files as published: numpy.core, protocol 2) and numpy 2 (numpy._core) spell it, and the
# protocol-5 form numpy writes for a contiguous array (_frombuffer). Nothing else is looked up.
_CIFAR_GLOBALS = {
    **{
        (module, "_reconstruct"): _np_multiarray._reconstruct
        for module in ("numpy.core.multiarray", "numpy._core.multiarray")
    },
    **{(module, "_frombuffer"): _np_numeric._frombuffer for module in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR-10 batch file: a dict of numpy arrays, lists, bytes and numbers. Any
    global other than those of _CIFAR_GLOBALS is refused before it is imported or called."""

    def find_class(self, module: str, name: str) -> object:
        found = _CIFAR_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name} (a CIFAR-10 batch holds only numpy arrays)")
        return found


def cifar10(root: Path, train: bool, seed: int) -> Split:
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    xs, ys = [], []
    for name in names:
        path = _find(root, [name], "CIFAR-10")
        with open(path, "rb") as f:
            try:
                batch = _CifarUnpickler(f, encoding="bytes").load()
            except pickle.UnpicklingError as e:
                raise UsageError(f"CIFAR-10 file {path}: {e}") from e
        xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(batch[b"labels"], dtype=np.int64))
    x, y = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
    return InMemoryData(x, y, [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616], 1 / 255), 3, 10


def read(dataset: str, root: Path, train: bool, seed: int) -> Split:
    """The train (`train`) or held-out split of the built-in dataset `dataset` (mnist, cifar10,
    digits, synthetic), its files under `root` where it reads any: (samples, channels, classes)."""
    reader = {"mnist": mnist, "cifar10": cifar10, "digits": digits, "synthetic": synthetic}[dataset]
    return reader(root, train, seed)
