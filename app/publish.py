"""A directory of files replaced whole (the export's model.pt and model.json): written into a
fresh sibling directory, each file synced, then swapped in by renames, so a reader, a second
export of the same name or a full disk never leaves a torn file or one run's model beside
another run's card. Standard library only: the orchestrator writes what comes out of an export
container with it too."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path


def publish(files: Mapping[str, bytes], into: Path) -> Path:
    """`files` (name -> bytes) as the whole content of directory `into`; on any error `into`
    stays as it was and nothing of this call is left beside it."""
    into.parent.mkdir(parents=True, exist_ok=True)
    new = _sibling(into, "new")
    new.mkdir()
    try:
        for name, data in files.items():
            with open(new / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        _swap(new, into)
    finally:
        shutil.rmtree(new, ignore_errors=True)  # gone already where the swap took it
    return into


def _sibling(into: Path, what: str) -> Path:
    return into.with_name(f".{into.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}")


def _swap(new: Path, into: Path) -> None:
    """`new` renamed to `into`, the old `into` moved aside first and then removed. Another
    publish may put its own `into` back between the two renames: moved aside in turn, and the
    rename tried again."""
    while True:
        old = _sibling(into, "old")
        try:
            into.rename(old)
        except FileNotFoundError:
            pass
        try:
            new.rename(into)
        except OSError as error:
            # another publish put its `into` back between the renames (it may have moved that
            # aside again since: its existence now says nothing); anything else is an error
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            shutil.rmtree(old, ignore_errors=True)
            continue
        shutil.rmtree(old, ignore_errors=True)
        fd = os.open(into.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return
