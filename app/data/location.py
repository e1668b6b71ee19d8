"""Where the data lives: a local path, or a URL read through fsspec (http(s)://, and s3:// through
s3fs, its credentials and endpoint from the AWS_* variables), and shard patterns expanded as bash
expands braces (braceexpand: `train-{000000..000003}.tar`)."""

from __future__ import annotations

from typing import IO

from app.config import UsageError
from app.contract import DATA_URL_SCHEMES, url_scheme


def is_url(path: str) -> bool:
    return url_scheme(path) is not None


def check(flag: str, path: str) -> None:
    """UsageError, one line, for a URL whose scheme the app does not read."""
    scheme = url_scheme(path)
    if scheme is not None and scheme not in DATA_URL_SCHEMES:
        schemes = ", ".join(f"{s}://" for s in DATA_URL_SCHEMES)
        raise UsageError(f"--{flag} {path}: the app does not read {scheme}:// URLs; give {schemes} or a local path")


def expand(flag: str, pattern: str) -> list[str]:
    """The shards a brace pattern names, in its order (`a-{0..2}.tar`: a-0.tar, a-1.tar, a-2.tar)."""
    from braceexpand import braceexpand

    check(flag, pattern)
    try:
        shards = list(braceexpand(pattern))
    except ValueError as error:  # braceexpand's UnbalancedBracesError
        raise UsageError(f"--{flag} {pattern}: {error}") from None
    return shards


def open_binary(path: str) -> IO[bytes]:
    """`path` opened for reading bytes, from the start, as a stream: a local file, or a URL
    through fsspec (a read that fails raises OSError, FileNotFoundError where nothing is there)."""
    if not is_url(path):
        return open(path, "rb")
    import fsspec

    return fsspec.open(path, "rb").open()
