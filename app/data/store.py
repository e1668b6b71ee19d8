"""Where the image cache's bytes live, and who may take them (app.data.imagecache).

- memory: `shared_storage` reserves the whole cache in /dev/shm at once.
- file: `write_cache_file` decodes every sample into a file under the cache dir named by
  `cache_key` (the files' paths, sizes and mtimes, and the decode size), written to a
  temporary name with its whole size reserved first (`reserve`) and renamed: a file with
  that name is complete. Old files are never deleted: writing a new one logs what else the
  directory holds; a temporary file no writer holds is removed (`remove_stale_temp_files`).
- `choose_mode` turns `auto` into memory or off, from the cache's size and the container's
  free /dev/shm and RAM; `shm_choice` makes the processes that share one /dev/shm (local
  processes, containers of one IPC namespace) choose one at a time, each reserving its cache
  before the next one measures; `exclusive` is the lock file both use.
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

from app.config import UsageError
from app.data.decode import decode_or_error, decoded_size, warn_bad
from app.data.imagefolder import NothingDecodes
from app.runtime.words import first_line

SHM_FRACTION = 0.5  # auto: the cache may take this much of the free /dev/shm (and of the available RAM)
SUFFIX = ".u8"
TMP_SUFFIX = ".tmp"
SHM = "/dev/shm"
SHM_LOCK = ".psc-image-cache.lock"  # in /dev/shm: held by the process choosing `auto` there

log = logging.getLogger("app.data.imagecache")  # the image cache's one log, whichever part writes


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
            raise NoRoom(no_room(nbytes, directory, e.strerror or str(e))) from None
    # A filesystem without fallocate: check the free space, then size the file.
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        raise NoRoom(no_room(nbytes, directory, "not enough free space"))
    os.ftruncate(fd, nbytes)


def no_room(nbytes: int, directory: Path, why: str) -> str:
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


def shared_storage(nbytes: int) -> torch.UntypedStorage:
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


def file_bytes(n: int, size: int) -> int:
    return 9 * n + n * 3 * size * size  # int64 labels, uint8 bad flags, uint8 images


def write_cache_file(path: Path, samples: list[tuple[str, int]], size: int, threads: int) -> None:
    """Decode every sample into `path`: written as a temporary file in the same directory,
    its whole size reserved first, then renamed, so a file at `path` is always whole. A
    bad file's slot holds the next decodable image and its label, as in the memory cache.
    The writer holds a lock on its temporary file: one nobody holds was left by a writer
    that died, and is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path.parent)
    n = len(samples)
    nbytes = file_bytes(n, size)
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
            for i, got in enumerate(pool.map(lambda s: decode_or_error(s[0], size), samples)):
                if isinstance(got, Exception):
                    bad[i] = 1
                    warn_bad(samples[i][0], got, int(bad.sum()))
                else:
                    images[i] = got.numpy()
        good = np.flatnonzero(bad == 0)
        if len(good) == 0:
            raise NothingDecodes.of(samples)
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
