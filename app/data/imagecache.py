"""ImageFolder decoded once: a uint8 cache at training resolution, augmented as tensor ops.

Used for `imagefolder` by --image_cache (train.image_cache); `python -m bench data` measures it.

- `CachedImageFolder` decodes each image once (Pillow, `to_rgb`, shorter side to
  `size`, the centre `size` x `size`) into one uint8 tensor. It holds the samples it
  is given: a worker gives it its own shard (app.data.datasets.stable_shard), so it
  decodes and holds ~1/N of the training images.
  - memory: a tensor in shared memory (/dev/shm), filled on first access. torch
    reserves a shared storage's whole size in /dev/shm when it is made (the pages
    count as Shmem at once, touched or not), so the cache is sized for the samples
    given, the shard, not the split. DataLoader worker processes fill the same cache
    (forked or spawned: it is a shared torch storage).
  - file: the whole shard decoded once, up front, into a file under the cache dir
    named by `cache_key` (the files' paths, sizes and mtimes, and the decode size),
    written to a temporary name and renamed: a file with that name is complete. A
    restarted worker, or a new run on the same files, maps it (page cache, not
    /dev/shm) and decodes nothing; a changed file list or size is a new name. Old
    files are never deleted: writing a new one logs what else the directory holds.
  Indexed by a list of indices: one gather per batch (use it with a BatchSampler and
  batch_size=None).
- `augment` crops, flips and normalises a uint8 batch as tensor ops on whatever
  device the batch is on: only uint8 crosses /dev/shm and pinned memory, 4x
  less than float32, and the float work runs on the training device.
- `choose_mode` turns `auto` into memory or off, from the cache's size and the
  container's free /dev/shm and RAM; `shm_choice` makes the processes that share one
  /dev/shm (local processes, containers of one IPC namespace) choose one at a time, each
  reserving its cache before the next one measures.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from app.data.imagefolder import CROP, MEAN, STD, to_rgb
from app.config import UsageError
from app.runtime import first_line

RESIZE = round(CROP * 8 / 7)  # 256: the size ImageFolderData resizes a 224 crop's image to
SHM_FRACTION = 0.5  # auto: the cache may take this much of the free /dev/shm (and of the available RAM)
SUFFIX = ".u8"
TMP_SUFFIX = ".tmp"
SHM = "/dev/shm"
SHM_LOCK = ".psc-image-cache.lock"  # in /dev/shm: held by the process choosing `auto` there

log = logging.getLogger(__name__)


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


def cache_bytes(images: int, crop: int) -> int:
    """Bytes of the uint8 cache of `images` images for crop side `crop`."""
    return images * 3 * decoded_size(crop) ** 2


def choose_mode(mode: str, nbytes: int, shm_free: int | None, memory_available: int | None) -> tuple[str, str]:
    """(memory | file | off, why) for --image_cache `mode` and a cache of `nbytes`.
    `auto` is memory when the cache takes at most SHM_FRACTION of the free /dev/shm and
    of the available RAM (a host that does not say counts as enough), else off."""
    if mode != "auto":
        return mode, f"--image_cache {mode}"
    gib = nbytes / 2**30
    for what, free, setting in (("/dev/shm", shm_free, "shm_size"), ("available memory", memory_available, "memory")):
        if free is not None and nbytes > SHM_FRACTION * free:
            return "off", (
                f"auto: the decoded images ({gib:.2f} GiB) would take more than half of the free "
                f"{what} ({free / 2**30:.2f} GiB); raise the container's {setting}, or set "
                "train.image_cache: file (kept on the state volume)"
            )
    return "memory", f"auto: the decoded images ({gib:.2f} GiB) fit in half of the free /dev/shm and memory"


@contextmanager
def exclusive(lock: Path, what: str) -> Iterator[None]:
    """Hold the lock file `lock` (made when missing, removed on release) against every process
    that takes it so; one line when another holds it (`what` it is doing). A file removed
    by its holder while this process waited for it is not the lock any more: taken anew."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("image cache: another process is %s (%s); waiting for it", what, lock)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        Path(lock).unlink(missing_ok=True)
        os.close(fd)


def shm_choice(mode: str, shm: str = SHM) -> AbstractContextManager[None]:
    """For `auto`: one process of those sharing the /dev/shm `shm` at a time measures its free
    space, chooses and reserves (the memory cache's storage is reserved whole when made), so
    none counts room another has just taken; a no-op for the other modes, or without `shm`."""
    if mode != "auto" or not os.access(shm, os.W_OK):
        return nullcontext()
    return exclusive(Path(shm) / SHM_LOCK, "choosing its image cache on this /dev/shm")


def cache_key(samples: list[tuple[str, int]], size: int) -> str:
    """A name for the decoded cache of `samples` at `size`: a hash of every file's path,
    label, size and mtime, and of the size; any change to one of them changes it."""
    digest = hashlib.sha256(f"uint8 3x{size}x{size} v1\n".encode())
    for path, label in samples:
        st = os.stat(path)
        digest.update(f"{path}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"images-{size}px-{len(samples)}-{digest.hexdigest()[:24]}"


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
                raise NoRoom(_no_room(_file_bytes(n, size), self.path.parent, error.strerror or str(error))) from None
            self._map()
            return
        storage = _shared_storage(max(1, n * 3 * size * size))
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
            if self.path.exists() and self.path.stat().st_size != _file_bytes(n, size):
                log.warning(
                    "image cache: %s is damaged (%d bytes, %d expected); decoding the shard again",
                    self.path,
                    self.path.stat().st_size,
                    _file_bytes(n, size),
                )
                self.path.unlink(missing_ok=True)
            if not self.path.exists():
                _write_cache_file(self.path, samples=self.samples, size=size, threads=threads)

    def _map(self) -> None:
        """Map the cache file (copy-on-write, lazily paged): labels, bad flags, images."""
        assert self.path is not None
        n, size = len(self.samples), self.size
        whole = torch.from_file(str(self.path), shared=False, size=_file_bytes(n, size), dtype=torch.uint8)
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
                    _warn_bad(self.samples[j][0], error, self.skipped_images)
                    continue
            self.images[i] = image
            self.labels[i] = self.labels[j]
            self.filled[i] = 1  # last: a reader never sees a half-written image as filled
            return
        raise OSError(f"no image under the data dir decodes (the first: {self.samples[0][0]})")

    def on_device(self, batch: torch.Tensor) -> torch.Tensor:
        return augment(batch, self.train, self.crop)


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
    two give the same pixels. The one float pass normalises."""
    b, c, h, w = batch.shape
    device = batch.device
    if train:
        tops = torch.randint(0, h - crop + 1, (b,), generator=generator)
        lefts = torch.randint(0, w - crop + 1, (b,), generator=generator)
        flip = torch.rand(b, generator=generator) < 0.5
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
    scale = (1.0 / (255.0 * STD)).to(device)
    shift = (MEAN / STD).to(device)
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


class NoRoom(Exception):
    """The cache file does not fit where it goes (a full volume); the message says where, how
    much it needs and how much is free, in one line."""


NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def reserve(fd: int, nbytes: int, directory: Path) -> None:
    """Give the file `fd` its `nbytes` on disk now (posix_fallocate), so that a full disk is
    one error here and not a SIGBUS when a page of the mapping is first written; NoRoom when
    it does not fit."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # no room (ENOSPC, EDQUOT, EFBIG)
            raise NoRoom(_no_room(nbytes, directory, e.strerror or str(e))) from None
    # A filesystem without fallocate: check the free space, then size the file.
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        raise NoRoom(_no_room(nbytes, directory, "not enough free space"))
    os.ftruncate(fd, nbytes)


def _no_room(nbytes: int, directory: Path, why: str) -> str:
    try:
        free = f"{shutil.disk_usage(directory).free / 2**30:.2f} GiB free"
    except OSError:
        free = "free space unknown"
    return f"no room for the {nbytes / 2**30:.2f} GiB cache file in {directory} ({why}; {free})"


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Remove the cache's temporary files in `directory` that no writer holds (a writer
    that died: its lock went with it); the ones removed."""
    removed = []
    for p in directory.glob(f".*{SUFFIX}.*{TMP_SUFFIX}"):
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live writer holds it
        finally:
            os.close(fd)
        p.unlink(missing_ok=True)
        removed.append(p)
        log.info("image cache: removed %s, left by a writer that did not finish", p)
    return removed


def _shared_storage(nbytes: int) -> torch.UntypedStorage:
    """`nbytes` of shared memory, all reserved in /dev/shm at once; UsageError (one line,
    what to set) when /dev/shm cannot hold them."""
    try:
        return torch.UntypedStorage._new_shared(nbytes)
    except RuntimeError as error:
        raise UsageError(
            f"--image_cache memory: cannot reserve {nbytes / 2**30:.2f} GiB in /dev/shm "
            f"({first_line(error)}); raise the container's shm_size, or set train.image_cache "
            "to file or auto"
        ) from None


def _warn_bad(path: str, error: Exception, skipped: int) -> None:
    log.warning(
        "skipping %s: cannot decode it (%s); the next image stands in for it (%d skipped)",
        path,
        type(error).__name__,
        skipped,
    )


def _file_bytes(n: int, size: int) -> int:
    return 9 * n + n * 3 * size * size  # int64 labels, uint8 bad flags, uint8 images


def _decode_or_error(path: str, size: int) -> torch.Tensor | Exception:
    """The decoded image, or why it does not decode."""
    try:
        return decode(path, size)
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - Pillow raises many types for a bad file
        return error


def _write_cache_file(path: Path, samples: list[tuple[str, int]], size: int, threads: int) -> None:
    """Decode every sample into `path`: written as a temporary file in the same directory,
    its whole size reserved first, then renamed, so a file at `path` is always whole. A
    bad file's slot holds the next decodable image and its label, as in the memory cache.
    The writer holds a lock on its temporary file: one nobody holds was left by a writer
    that died, and is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path.parent)
    n = len(samples)
    nbytes = _file_bytes(n, size)
    others = [p for p in path.parent.glob("*" + SUFFIX) if p != path]
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        reserve(fd, nbytes, path.parent)
        out = np.memmap(tmp, dtype=np.uint8, mode="r+", shape=(nbytes,))
        labels = out[: 8 * n].view(np.int64)
        bad = out[8 * n : 9 * n]
        images = out[9 * n :].reshape(n, 3, size, size)
        labels[:] = [label for _, label in samples]
        with ThreadPoolExecutor(max(1, threads)) as pool:
            for i, got in enumerate(pool.map(lambda s: _decode_or_error(s[0], size), samples)):
                if isinstance(got, Exception):
                    bad[i] = 1
                    _warn_bad(samples[i][0], got, int(bad.sum()))
                else:
                    images[i] = got.numpy()
        good = np.flatnonzero(bad == 0)
        if len(good) == 0:
            raise OSError(f"no image under the data dir decodes (the first: {samples[0][0]})")
        for slot in np.flatnonzero(bad):  # the next decodable image stands in, wrapping round
            j = good[np.searchsorted(good, slot) % len(good)]
            images[slot], labels[slot] = images[j], labels[j]
        out.flush()
        del out, labels, bad, images
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    log.info("image cache: wrote %s (%d images, %.2f GiB)", path, n, path.stat().st_size / 2**30)
    if others:
        held = sum(p.stat().st_size for p in others if p.exists())
        log.info(
            "image cache: %s also holds %d other cache file(s), %.2f GiB, kept (other shards or "
            "older file lists); delete the ones no run needs",
            path.parent,
            len(others),
            held / 2**30,
        )
