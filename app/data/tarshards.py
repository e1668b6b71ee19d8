"""`webdataset`: images in tar shards, read as a stream from a brace pattern (a URL or a path).

A shard holds `<key>.png` (or .jpg, .jpeg) and `<key>.cls`, the class index as text, the members
of one key side by side, as webdataset writes them. Each tar is read once front to back in
streaming mode (tarfile's `r|*`), through fsspec for a URL (app/data/location.py). Images take
the transforms of imagefolder (app/data/imagefolder.py `prepare`): a random crop and flip for
training, the centre crop for evaluation. The shards of a pass are split across ranks and
DataLoader processes (app/data/streams.py); within a reader, samples are shuffled through a
buffer of SHUFFLE_BUFFER for training. The classes are counted from the held-out shards' .cls
members (their images are not decoded): every process reads them once as it starts.
"""

from __future__ import annotations

import io
import random
import tarfile
from collections.abc import Iterator
from typing import Any

import torch

from app.config import UsageError
from app.contract import SHARD_DATASETS as DATASETS
from app.data import location
from app.data.imagefolder import CROP, prepare
from app.data.streams import Stream

IMAGE_SUFFIXES = ("png", "jpg", "jpeg")
SHUFFLE_BUFFER = 512


def members(shard: str) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {suffix: bytes}) of each sample of a tar shard, in the tar's order; a member's key is
    its path up to the first dot of its name, its suffix the rest (lower case)."""
    key: str | None = None
    found: dict[str, bytes] = {}
    with location.open_binary(shard) as raw, tarfile.open(fileobj=raw, mode="r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            folder, _, name = member.name.rpartition("/")
            stem, dot, suffix = name.partition(".")
            if not dot:
                continue
            this = f"{folder}/{stem}" if folder else stem
            if this != key and key is not None:
                yield key, found
                found = {}
            key = this
            got = tar.extractfile(member)
            if got is not None:
                found[suffix.lower()] = got.read()
    if key is not None:
        yield key, found


def labelled(shard: str) -> Iterator[tuple[str, bytes, int]]:
    """(key, image bytes, class) of each sample of `shard` that has an image and a class."""
    for key, found in members(shard):
        image = next((found[s] for s in IMAGE_SUFFIXES if s in found), None)
        if image is None or "cls" not in found:
            continue
        yield key, image, class_of(shard, key, found["cls"])


def class_of(shard: str, key: str, text: bytes) -> int:
    try:
        value = int(text.decode().strip())
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(f"webdataset: {shard}: {key}.cls holds {text[:20]!r}; must be a class index (0, 1, ...)")
    return value


class TarShards(Stream):
    """(image tensor 3xSxS, class) of each sample of the shards; random crop, flip and shuffle when `train`."""

    def __init__(self, shards: list[str], train: bool, crop: int = CROP, seed: int = 0) -> None:
        super().__init__(shards, seed, shuffle=train)
        self.train, self.crop = train, crop

    def read(self, part: Any) -> Iterator[tuple[torch.Tensor, int]]:
        from PIL import Image

        for _, image, label in labelled(part):
            with Image.open(io.BytesIO(image)) as img:
                yield prepare(img, self.crop, self.train), label

    def mixed(self, samples: Iterator[Any], loader: int) -> Iterator[Any]:
        if not self.train:
            return samples
        return shuffled(samples, random.Random(self.seed * 1_000_003 + self.epoch * 101 + loader))


def shuffled(samples: Iterator[Any], rng: random.Random, size: int = SHUFFLE_BUFFER) -> Iterator[Any]:
    """`samples` through a buffer of `size`: each comes out at a random place of the buffer."""
    buffer: list[Any] = []
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        i = rng.randrange(size)
        buffer[i], sample = sample, buffer[i]
        yield sample
    rng.shuffle(buffer)
    yield from buffer


def load(pattern: str, flag: str, train: bool, crop: int, seed: int) -> TarShards:
    """The shards `pattern` names, checked to be there where they are local files."""
    shards = location.expand(flag, pattern)
    missing = [s for s in shards if not location.is_url(s) and not _is_file(s)]
    if missing:
        raise UsageError(f"--{flag} {pattern}: no shard at {missing[0]} ({len(missing)} of {len(shards)} missing)")
    return TarShards(shards, train, crop, seed)


def count_classes(pattern: str, flag: str) -> int:
    """1 + the largest class index of the shards' .cls members (their images are not decoded)."""
    most = -1
    try:
        for shard in location.expand(flag, pattern):
            for _, _, label in labelled(shard):
                most = max(most, label)
    except (OSError, tarfile.TarError) as error:
        raise UsageError(f"--{flag} {pattern}: cannot read its shards: {type(error).__name__}: {error}") from None
    if most < 0:
        raise UsageError(f"--{flag} {pattern}: its shards hold no <key>.png|jpg with a <key>.cls")
    return most + 1


def _is_file(path: str) -> bool:
    from pathlib import Path

    return Path(path).is_file()
