"""CIFAR-10's python batches are unpickled with only numpy's array reconstruction allowed."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from app.config import UsageError
from app.data import builtin


def _batch(n: int, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8), rng.integers(0, 10, n).tolist()


def _short(s: bytes) -> bytes:
    return b"U" + bytes([len(s)]) + s  # SHORT_BINSTRING: a Python 2 str


def _python2_batch(data: np.ndarray, labels: list[int]) -> bytes:
    """The pickle Python 2's cPickle wrote for the published batches (protocol 2, numpy 1's
    numpy.core.multiarray, str for every string), here of `data` and `labels`."""
    dtype = (
        b"cnumpy\ndtype\n" + _short(b"u1") + b"K\x00K\x01\x87R"  # dtype('u1', 0, 1)
        b"(K\x03" + _short(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"  # its state, BUILD
    )
    shape = b"M" + struct.pack("<H", data.shape[0]) + b"M" + struct.pack("<H", data.shape[1]) + b"\x86"
    raw = data.tobytes()
    array = (
        b"cnumpy.core.multiarray\n_reconstruct\n"
        b"cnumpy\nndarray\nK\x00\x85" + _short(b"b") + b"\x87R"  # _reconstruct(ndarray, (0,), 'b')
        b"(K\x01" + shape + dtype + b"\x89T" + struct.pack("<I", len(raw)) + raw + b"tb"  # state, BUILD
    )
    label_list = b"](" + b"".join(b"K" + bytes([label]) for label in labels) + b"e"
    return b"\x80\x02}(" + _short(b"data") + array + _short(b"labels") + label_list + b"u."


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    return folder


@pytest.mark.parametrize("writer", ["python2", "protocol4", "protocol5"])
def test_batches_load_as_written(tmp_path, writer):
    folder = _folder(tmp_path)
    written = {}
    for seed, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        data, labels = _batch(3 + seed, seed)
        written[name] = data, labels
        if writer == "python2":
            raw = _python2_batch(data, labels)
        else:
            raw = pickle.dumps({b"data": data, b"labels": labels}, protocol=int(writer[-1]))
        (folder / name).write_bytes(raw)
    for train, names in ((True, [f"data_batch_{i}" for i in range(1, 6)]), (False, ["test_batch"])):
        split, channels, classes = builtin.read("cifar10", tmp_path, train, seed=0)
        assert (channels, classes) == (3, 10)
        expected = np.concatenate([written[name][0] for name in names]).reshape(-1, 3, 32, 32)
        np.testing.assert_array_equal(split.x.numpy(), expected)
        assert split.y.tolist() == [label for name in names for label in written[name][1]]


class _Opens:
    """Unpickled by a full unpickler, opens (and so creates) `path`."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class _Shell:
    """Unpickled by a full unpickler, creates `path` through a shell."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.mark.parametrize(
    ("payload", "forbidden"), [(_Opens, f"{open.__module__}.open"), (_Shell, f"{os.system.__module__}.system")]
)
def test_a_forbidden_global_is_refused_and_never_called(tmp_path, payload, forbidden):
    folder = _folder(tmp_path)
    marker = tmp_path / "marker"
    data, labels = _batch(2, 0)
    raw = pickle.dumps({b"data": data, b"labels": labels, b"x": payload(marker)})
    (folder / "test_batch").write_bytes(raw)
    with pytest.raises(UsageError) as raised:
        builtin.read("cifar10", tmp_path, False, seed=0)
    message = str(raised.value)
    assert message == (
        f"CIFAR-10 file {folder / 'test_batch'}: forbidden global {forbidden} "
        "(a CIFAR-10 batch holds only numpy arrays)"
    )
    assert "\n" not in message
    assert isinstance(raised.value.__cause__, pickle.UnpicklingError)
    assert not marker.exists()
    pickle.loads(raw)  # the control: a full unpickler does run the payload
    assert marker.exists()


def test_a_numpy_global_outside_the_list_is_refused(tmp_path):
    folder = _folder(tmp_path)
    raw = pickle.dumps({b"data": np.load, b"labels": []}, protocol=4)  # a global of numpy, not an array's
    (folder / "test_batch").write_bytes(raw)
    with pytest.raises(UsageError, match=r"forbidden global numpy\.load "):
        builtin.read("cifar10", tmp_path, False, seed=0)
