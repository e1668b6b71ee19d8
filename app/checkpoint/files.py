"""Checkpoints on disk: written whole or not at all, verified before they are loaded.

A checkpoint is `ckpt-<version>-<digest>.pt`, a plain `torch.save` file whose
name carries the first 16 hex digits of its SHA-256: a truncated or damaged
file no longer matches its name and is skipped with a warning, never loaded.
Writes go to a temp file in the same directory, are fsynced, then renamed
(and the directory fsynced), so a crash or a full disk leaves the previous
checkpoints as they were. The newest few are kept; "newest" is the write
time. A new run that does not continue the files it finds moves them, whole
and unchanged, to `previous/<run id>/` (`set_aside`): out of its way and out
of reach of its pruning, never deleted.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import resource
import shutil
from pathlib import Path
from typing import Any

import torch

from app.config import UsageError
from app.runtime.words import first_line

log = logging.getLogger("app.checkpoint")
KEEP = 3
PREVIOUS = "previous"  # <directory>/previous/<run id>/: the files of runs a new run did not continue
_NAME = re.compile(r"^ckpt-(\d+)-([0-9a-f]{16})\.pt$")
REQUIRED = ("version", "model", "optimizer", "progress", "finished")


def cpu_copy(obj: Any) -> Any:
    """A copy of a (nested dict/list) state on CPU, detached: what a checkpoint holds, safe
    from later in-place updates."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cpu_copy(v) for v in obj]
    return obj


def write_atomically(data: bytes, path: Path) -> None:
    """`data` at `path`, or (on any error) `path` as it was: temp file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_atomically(obj: Any, path: Path) -> None:
    """torch.save `obj` to `path` atomically (final.pt: a plain file for users)."""
    write_atomically(serialize(obj), path)


def serialize(obj: Any) -> bytes:
    """`obj` as torch.save writes it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a (nested dict/list) state: about what its file takes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def size_text(nbytes: float) -> str:
    """`0.61 MB`, `12.40 GB`: a size for a log line."""
    return f"{nbytes / 2**30:.2f} GB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MB"


def room(directory: str | Path) -> tuple[int, int | None]:
    """(bytes free on the filesystem of `directory`, the largest file this process may
    write: its RLIMIT_FSIZE, or None when unlimited)."""
    free = shutil.disk_usage(directory).free
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return free, None if limit == resource.RLIM_INFINITY else limit


def final_state(directory: str | Path) -> dict[str, Any] | None:
    """What `<directory>/final.pt` says of its run (its values other than the model's, the
    optimizer's and a shard's slice: version, run_id, the job's identity...), or None when
    there is none or it does not load. Mapped, not read whole."""
    path = Path(directory) / "final.pt"
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 - any unpickling failure: not a final model
        log.warning("%s does not load (%s); not counted as the end of its run", path, first_line(error))
        return None
    if not isinstance(state, dict) or "version" not in state:
        return None
    return {k: v for k, v in state.items() if not isinstance(v, (dict, torch.Tensor))}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def listing(directory: str | Path) -> list[Path]:
    """Checkpoint files, newest first (write time, then version)."""
    found = []
    for path in Path(directory).glob("ckpt-*.pt"):
        m = _NAME.match(path.name)
        if m:
            try:
                found.append((path.stat().st_mtime_ns, int(m.group(1)), path))
            except FileNotFoundError:  # pruned meanwhile
                continue
    return [p for _, _, p in sorted(found, reverse=True)]


def save(state: dict[str, Any], directory: str | Path, keep: int = KEEP) -> Path:
    """Write a checkpoint of `state` (which has `version`); keep the newest `keep`.

    Raises OSError (disk full, read-only...) with every earlier checkpoint intact.
    """
    data = serialize(state)
    path = Path(directory) / f"ckpt-{state['version']:08d}-{_digest(data)}.pt"
    write_atomically(data, path)
    for old in listing(directory)[keep:]:
        old.unlink(missing_ok=True)
    return path


def verify(path: Path) -> dict[str, Any]:
    """The checkpoint's state; ValueError when it is truncated, damaged or incomplete."""
    m = _NAME.match(path.name)
    if not m:
        raise ValueError("not a checkpoint file name")
    data = path.read_bytes()
    if _digest(data) != m.group(2):
        raise ValueError(f"its {len(data)} bytes do not match the checksum in its name (truncated or damaged)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unpickling failure means "do not use"
        raise ValueError(f"torch.load failed: {error}") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED):
        raise ValueError(f"it lacks one of {', '.join(REQUIRED)}")
    return state


def newest_good(directory: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies; each bad one on the way is skipped with a warning."""
    for path in listing(directory):
        try:
            return path, verify(path)
        except (ValueError, OSError) as error:
            log.warning("skipping checkpoint %s: %s", path, error)
    return None


def check_writable(directory: str | Path) -> None:
    """Create `directory` (and its parents) when missing; UsageError (one line) when this
    process cannot create it or a file in it: found at the start, not after a whole run
    whose every checkpoint and final.pt failed."""
    probe = Path(directory) / f".write-probe-{os.getpid()}.tmp"
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise UsageError(
            f"--checkpoint_dir {directory}: cannot write there ({error.strerror or error}); "
            "give the process a writable directory (the state volume: /state/checkpoints)"
        ) from None


def set_aside_runs(directory: str | Path) -> list[tuple[Path, tuple[Path, dict[str, Any]]]]:
    """The runs set aside under `<directory>/previous/`, newest first: (its directory, its
    newest good checkpoint)."""
    found = []
    for where in (Path(directory) / PREVIOUS).glob("*"):
        newest = newest_good(where) if where.is_dir() else None
        if newest is not None:
            found.append((newest[0].stat().st_mtime_ns, where, newest))
    return [(where, newest) for _, where, newest in sorted(found, key=lambda f: f[0], reverse=True)]


def move_back(where: Path, directory: str | Path) -> int:
    """Move a set-aside run's files (checkpoints, final.pt, shard<i>/) back into `directory`;
    how many. A rename: nothing copied, nothing deleted."""
    count = 0
    for path in sorted(p for p in where.rglob("*") if p.is_file()):
        dest = Path(directory) / path.relative_to(where)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        count += 1
    return count


def remove_temp_files(directory: str | Path) -> int:
    """Delete temp files a killed writer left behind (one PS writes a directory)."""
    count = 0
    for tmp in Path(directory).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
        count += 1
    return count


def set_aside(directory: str | Path, label: str) -> tuple[Path, int] | None:
    """Move every checkpoint, final.pt and PS shard checkpoint (`shard<i>/`) of `directory`
    to `<directory>/previous/<label>/` (made unique with -2, -3... when taken), keeping
    their names; (that directory, files moved), or None when there was nothing to move.
    A rename within one filesystem: nothing is copied, nothing is deleted."""
    root = Path(directory)
    files = [
        p
        for p in [*root.glob("ckpt-*.pt"), root / "final.pt", *root.glob("shard*/ckpt-*.pt")]
        if _NAME.match(p.name) or p.name == "final.pt"
    ]
    files = [p for p in files if p.is_file()]
    if not files:
        return None
    target = root / PREVIOUS / label
    n = 1
    while target.exists():
        n += 1
        target = root / PREVIOUS / f"{label}-{n}"
    for path in files:
        dest = target / path.relative_to(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
    return target, len(files)
