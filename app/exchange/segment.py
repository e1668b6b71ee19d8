"""A shared-memory segment: one file in /dev/shm that a PS process owns and the workers on its
host map, so that pushes and replies cross as memory instead of through the job's sockets.

The file holds a one-page header (a magic, the segment's random nonce, and from byte
WORDS_AT one 32-bit word per region: how far the PS has written it, app.exchange.progress)
and then named regions
of `floats` float32 values each, every one starting on a page boundary (a GPU worker pins its
own regions with cudaHostRegister). The owner creates it, reserves its whole size at once
(`posix_fallocate`: a /dev/shm too small for it is one error at the start, never a SIGBUS
later), maps it and holds an exclusive `flock` on it for as long as it lives; the worker maps
it by the path and checks the nonce its PS gave it, so a file of the same name that is not
the same memory (another host, another IPC namespace) is refused, not used.

The directory (--shm_dir, /dev/shm by default; `orchestrator local` gives each run its own,
`/dev/shm/psc-<launcher pid>-<name>-<run id>`) must be on a tmpfs: elsewhere the segment would be written back
to a disk. It is made (0700) only where its parent is a tmpfs directory already; otherwise the
exchange is not had here (one line says why) and nothing is created.

Nothing is left behind: the owner unlinks the file when it ends; a file whose owner was killed
(no lock held any more) is removed by `sweep`, which every PS runs before it creates its own:
in its directory, in the `psc-*` directories in it and, for a run's own directory, in the
other runs' beside it, each removed once nothing of it is left. A worker never unlinks: its
mapping keeps the memory alive until it unmaps, whatever happens to the name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from app.contract import SHM_PAGE

log = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm"
PREFIX = "psc-"
SUFFIX = ".shm"
MAKING = ".making"  # a segment being made: .psc-....making, renamed once it is whole
MAGIC = b"PSCSHM01"
PAGE = SHM_PAGE
HEADER = PAGE  # magic, nonce, the regions' words; the rest of the page is reserved
WORDS_AT = 512  # where the regions' words start in the header (one each, in region order)
FLOAT = 4
STALE_SECONDS = 60.0  # an empty psc-* directory unchanged this long is a dead run's: swept


class ShmUnavailable(RuntimeError):
    """Shared memory cannot be had here; the message says why, in one line."""


class Offer(NamedTuple):
    """What a worker needs to map a PS's segment (sent in the PS's answer to a join)."""

    path: str
    nonce: str
    floats: int  # values in each region
    names: tuple[str, ...]  # the regions, in file order


def stride(floats: int) -> int:
    """Bytes from one region's start to the next: `floats` values rounded up to a page."""
    return -(-floats * FLOAT // PAGE) * PAGE


def segment_bytes(floats: int, regions: int) -> int:
    """The size of a segment of `regions` regions of `floats` values, header included
    (app.contract.exchange_bytes says the same for the render's sizing)."""
    return HEADER + regions * stride(floats)


class Segment:
    """A mapped segment: `region(name)` is a float32 view of `floats` values, no copy."""

    def __init__(self, path: str, nonce: str, floats: int, names: Sequence[str], fd: int | None) -> None:
        self.path, self.nonce, self.floats, self.names = path, nonce, floats, tuple(names)
        self._index = {name: i for i, name in enumerate(self.names)}
        self._fd = fd  # the owner's descriptor (it holds the lock); None for a worker
        self.size = segment_bytes(floats, len(self.names))
        with open(path, "r+b", buffering=0) as file:
            self._map = mmap.mmap(file.fileno(), self.size)
        self.all = torch.frombuffer(self._map, dtype=torch.uint8)  # the whole file, for pinning
        self.base = self.all.data_ptr()

    @classmethod
    def create(cls, directory: str, floats: int, names: Sequence[str]) -> Segment:
        """A new segment in `directory`, owned (locked) by this process; ShmUnavailable when
        the directory is not a tmpfs one (`make_directory`) or too small for it. It is made
        under a name `sweep` does not look at, locked, reserved and stamped, and only then
        renamed to its own."""
        if os.path.basename(directory.rstrip("/")).startswith(PREFIX):  # a run's own: the other runs' beside it
            sweep(os.path.dirname(directory.rstrip("/")))
        size = segment_bytes(floats, len(names))
        stem = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        path, making = os.path.join(directory, stem + SUFFIX), os.path.join(directory, f".{stem}{MAKING}")
        for tries_left in (1, 0):
            made = make_directory(directory)
            sweep(directory)
            try:
                fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileNotFoundError:
                if tries_left:  # another run's sweep took the empty directory meanwhile: make it again
                    continue
                raise ShmUnavailable(f"cannot create a file in {directory}: it was removed meanwhile") from None
            except OSError as error:
                if made:
                    with contextlib.suppress(OSError):
                        os.rmdir(directory)
                raise ShmUnavailable(f"cannot create a file in {directory}: {error.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _reserve(fd, size, directory)
            nonce = secrets.token_hex(8)
            os.pwrite(fd, MAGIC + bytes.fromhex(nonce), 0)
            os.rename(making, path)
            return cls(path, nonce, floats, names, fd)
        except BaseException:
            for name in (making, path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
            os.close(fd)
            if made:
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
            raise

    @classmethod
    def attach(cls, offer: Offer) -> Segment:
        """Map the segment `offer` names; ShmUnavailable when this process does not see that
        very memory (no such file, another file of that name, no permission)."""
        try:
            with open(offer.path, "rb") as file:
                head = file.read(len(MAGIC) + 8)
                actual = os.fstat(file.fileno()).st_size
        except OSError as error:
            raise ShmUnavailable(f"{offer.path}: {error.strerror}") from None
        if head != MAGIC + bytes.fromhex(offer.nonce):
            raise ShmUnavailable(f"{offer.path} is another segment than the parameter server's (its nonce differs)")
        expected = segment_bytes(offer.floats, len(offer.names))
        if actual < expected:
            raise ShmUnavailable(f"{offer.path} holds {actual} bytes, the parameter server's {expected}")
        try:
            return cls(offer.path, offer.nonce, offer.floats, offer.names, None)
        except OSError as error:
            raise ShmUnavailable(f"{offer.path}: {error.strerror}") from None

    def offer(self) -> Offer:
        return Offer(self.path, self.nonce, self.floats, self.names)

    def region(self, name: str) -> torch.Tensor:
        """Region `name` as `floats` float32 values (a view of the mapping)."""
        start = self._start(self._index[name])
        return self.all[start : start + self.floats * FLOAT].view(torch.float32)

    def byte_range(self, name: str) -> tuple[int, int]:
        """(address, bytes) of region `name`, page aligned: what a GPU worker pins."""
        return self.base + self._start(self._index[name]), stride(self.floats)

    def word_address(self, name: str) -> int | None:
        """The address of region `name`'s word in the header (app.exchange.progress); None for
        a region past the words the header holds."""
        index = self._index[name]
        at = WORDS_AT + 4 * index
        return self.base + at if at + 4 <= HEADER else None

    def name_of(self, tensor: torch.Tensor) -> str | None:
        """The region `tensor` starts at, if it starts at one."""
        offset = tensor.data_ptr() - self.base - HEADER
        if offset < 0 or offset % stride(self.floats):
            return None
        index = offset // stride(self.floats)
        return self.names[index] if index < len(self.names) else None

    def _start(self, index: int) -> int:
        return HEADER + index * stride(self.floats)

    def owned(self) -> bool:
        """Whether the process that made the segment still holds it (its lock): False once it
        ended, however it ended."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False  # removed: its owner closed it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except OSError:  # its owner holds it
            return True
        finally:
            os.close(fd)

    def close(self) -> None:
        """The owner removes the file and lets go of its lock. The mapping stays until no
        tensor views it any more (each view holds the mapping: unmapping under a live view
        would leave it pointing at nothing)."""
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = None


def make_directory(directory: str) -> bool:
    """Check that `directory` is a tmpfs directory, making it (0700) when missing and its parent
    is one; whether it was made. ShmUnavailable, in one line, when it is not absolute, not
    there and cannot be made there, or not on a tmpfs: nothing is created then."""
    if not os.path.isabs(directory):
        raise ShmUnavailable(f"{directory} is not an absolute path")
    made = False
    if not os.path.isdir(directory):
        parent = os.path.dirname(directory.rstrip("/")) or "/"
        if not os.path.isdir(parent):
            raise ShmUnavailable(f"{directory} does not exist, nor does {parent}")
        kind = filesystem_of(parent)
        if kind not in ("tmpfs", ""):
            raise ShmUnavailable(f"{directory} does not exist, and {parent} is on {kind}, not a tmpfs")
        try:
            os.mkdir(directory, 0o700)
            made = True
        except FileExistsError:
            pass  # another PS process of the run made it meanwhile
        except OSError as error:
            raise ShmUnavailable(f"cannot make {directory}: {error.strerror}") from None
    kind = filesystem_of(directory)
    if kind not in ("tmpfs", ""):
        raise ShmUnavailable(f"{directory} is on {kind}, not a tmpfs: a segment there would be written to disk")
    return made


def filesystem_of(path: str) -> str:
    """The type of the filesystem `path` is on (`tmpfs`, `ext4`...), from /proc/self/mountinfo;
    '' where that cannot be read."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    path = os.path.realpath(path)
    found, kind = "", ""
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])  # \040: a space
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(found):  # the deepest; of equals, the last mounted
            found, kind = point, rest.split()[0]
    return kind


def _reserve(fd: int, size: int, directory: str) -> None:
    """Reserve `size` bytes for the file now; ShmUnavailable naming what is free when they
    do not fit (tmpfs otherwise allocates on first touch, and a full one is a SIGBUS)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise ShmUnavailable(f"cannot reserve {size / 1e6:.0f} MB in {directory}: {error.strerror}") from None
        free = free_bytes(directory)
        raise ShmUnavailable(
            f"{directory} has {free / 1e6:.0f} MB free, the exchange needs {size / 1e6:.0f} MB "
            "(raise shm_size, or fewer workers.max)"
        ) from None


def free_bytes(directory: str) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def sweep(directory: str = DEFAULT_DIR) -> list[str]:
    """Remove what processes that ended left in `directory` and in the `psc-*` directories in it
    (runs' own, `orchestrator local`'s): segments whose owner is gone (no lock held on them),
    half-made ones of a process that died making them, and such a directory once nothing is
    left in it; the paths removed. A live owner's segment, a directory a live run may still fill
    (emptied by nobody, changed in the last minute), and files that are not segments stay."""
    removed = _sweep_files(Path(directory))
    for run in sorted(Path(directory).glob(f"{PREFIX}*")):
        if run.is_dir() and not run.is_symlink():
            gone = _sweep_files(run)
            removed += gone
            if _remove_if_ended(run, emptied=bool(gone)):
                removed.append(str(run))
    if removed:
        log.info("removed %d shared-memory file(s) left by processes that ended: %s", len(removed), removed)
    return removed


def _sweep_files(directory: Path) -> list[str]:
    found = sorted(directory.glob(f"{PREFIX}*{SUFFIX}")) + sorted(directory.glob(f".{PREFIX}*{MAKING}"))
    return [str(path) for path in found if _remove_unowned(path)]


def _remove_if_ended(run: Path, emptied: bool) -> bool:
    """Remove a run's directory that is empty: just emptied of a dead owner's files, or left
    unchanged for STALE_SECONDS (a run that made it and ended). rmdir: never one with files."""
    try:
        if not emptied and time.time() - run.stat().st_mtime < STALE_SECONDS:
            return False
        run.rmdir()
        return True
    except OSError:  # not empty, or gone already
        return False


def _remove_unowned(path: Path) -> bool:
    """Unlink `path` if nobody holds its lock (a half-made one only once it is a minute old:
    its maker locks it right after creating it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if path.name.endswith(MAKING) and time.time() - os.fstat(fd).st_mtime < 60:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink()
        return True
    except OSError:  # its owner holds it, or it is gone already
        return False
    finally:
        os.close(fd)
