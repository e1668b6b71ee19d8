"""ImageFolder decoded once: a uint8 cache at training resolution, augmented as tensor ops.

Used for `imagefolder` by --image_cache (train.image_cache); `python -m bench data` measures it.
Its parts: app.data.decode (one file to uint8), app.data.store (the memory and file caches'
bytes, /dev/shm reservation locks, `auto`'s choice), app.data.augment (crops, flips and
normalisation on the training device).

`CachedImageFolder` decodes each image once (Pillow, `to_rgb`, shorter side to `size`,
the centre `size` x `size`) into one uint8 tensor. It holds the samples it is given: a
worker gives it its own shard (app.data.datasets.stable_shard), so it decodes and holds
~1/N of the training images.
- memory: a tensor in shared memory (/dev/shm), filled on first access. torch reserves a
  shared storage's whole size in /dev/shm when it is made (the pages count as Shmem at
  once, touched or not), so the cache is sized for the samples given, the shard, not the
  split. DataLoader worker processes fill the same cache (forked or spawned: it is a
  shared torch storage).
- file: the whole shard decoded once, up front, into a file under the cache dir
  (app.data.store); a restarted worker, or a new run on the same files, maps it (page
  cache, not /dev/shm) and decodes nothing.
Indexed by a list of indices: one gather per batch (use it with a BatchSampler and
batch_size=None).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.utils.data import Dataset

from app.data.augment import augment
from app.data.decode import decode, decoded_size, warn_bad
from app.data.imagefolder import CROP, NothingDecodes
from app.data.store import (
    NO_ROOM,
    SUFFIX,
    NoRoom,
    cache_key,
    exclusive,
    file_bytes,
    no_room,
    shared_storage,
    write_cache_file,
)

log = logging.getLogger(__name__)


class CachedImageFolder(Dataset):
    """(uint8 batch B x 3 x size x size, labels) for a list of indices; each file decoded once.

    A file that does not decode is skipped as ImageFolderData skips it (one warning,
    counted in `skipped_images`): the next decodable image, and its label, stand in.
    `on_device` turns a batch, once on the training device, into the model's input.
    `cache_dir` given: the file cache (see the module); else the memory cache.
    `threads`: decoding threads for the file cache's one pass (Pillow releases the GIL)."""

    def __init__(
        self,
        samples: list[tuple[str, int]],
        train: bool,
        crop: int = CROP,
        cache_dir: str | Path | None = None,
        threads: int = 1,
    ) -> None:
        size = decoded_size(crop)
        self.samples, self.train, self.size, self.crop = samples, train, size, crop
        self.path: Path | None = None
        n = len(samples)
        if cache_dir is not None and n:  # an empty shard (more workers than images) needs no file
            self.path = Path(cache_dir) / (cache_key(samples, size) + SUFFIX)
            try:
                self._file(threads)
            except OSError as error:  # a full volume: not even the directory or the lock fits
                if error.errno not in NO_ROOM:
                    raise
                raise NoRoom(no_room(file_bytes(n, size), self.path.parent, error.strerror or str(error))) from None
            self._map()
            return
        storage = shared_storage(max(1, n * 3 * size * size))
        self.images = torch.empty(0, dtype=torch.uint8).set_(storage)[: n * 3 * size * size].view(n, 3, size, size)
        self.filled = torch.zeros(n, dtype=torch.uint8).share_memory_()
        self.bad = torch.zeros(n, dtype=torch.uint8).share_memory_()
        # A skipped file's slot takes its stand-in's label too.
        self.labels = torch.tensor([label for _, label in samples], dtype=torch.long).share_memory_()

    def _file(self, threads: int) -> None:
        """The cache file, whole: written here, or by another process meanwhile."""
        assert self.path is not None
        n, size = len(self.samples), self.size
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One process writes a cache file; the others that need it (every worker, when it
        # holds the whole split) wait, then map what it wrote.
        with exclusive(self.path.with_name(f".{self.path.name}.lock"), "writing it"):
            if self.path.exists() and self.path.stat().st_size != file_bytes(n, size):
                log.warning(
                    "image cache: %s is damaged (%d bytes, %d expected); decoding the shard again",
                    self.path,
                    self.path.stat().st_size,
                    file_bytes(n, size),
                )
                self.path.unlink(missing_ok=True)
            if not self.path.exists():
                write_cache_file(self.path, self.samples, size, threads)

    def _map(self) -> None:
        """Map the cache file (copy-on-write, lazily paged): labels, bad flags, images."""
        assert self.path is not None
        n, size = len(self.samples), self.size
        whole = torch.from_file(str(self.path), shared=False, size=file_bytes(n, size), dtype=torch.uint8)
        self.labels = whole[: 8 * n].view(torch.int64)
        self.bad = whole[8 * n : 9 * n]
        self.images = whole[9 * n :].view(n, 3, size, size)
        self.filled = torch.ones(n, dtype=torch.uint8)

    def __getstate__(self) -> dict:
        if self.path is None:
            return self.__dict__  # shared-memory tensors: torch pickles them by handle
        return {k: v for k, v in self.__dict__.items() if k not in ("labels", "bad", "images", "filled")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.path is not None:  # a spawned loader process maps the file itself
            self._map()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def skipped_images(self) -> int:
        return int(self.bad.sum().item())

    @property
    def nbytes(self) -> int:
        return self.images.numel()

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
                    raise  # the data dir vanished (app.data.datasets.batches)
                except Exception as error:  # noqa: BLE001 - Pillow raises many types for a bad file
                    self.bad[j] = 1
                    warn_bad(self.samples[j][0], error, self.skipped_images)
                    continue
            self.images[i] = image
            self.labels[i] = self.labels[j]
            self.filled[i] = 1  # last: a reader never sees a half-written image as filled
            return
        raise NothingDecodes.of(self.samples)

    def on_device(self, batch: torch.Tensor) -> torch.Tensor:
        return augment(batch, self.train, self.crop)
