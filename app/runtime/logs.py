"""Logging: diagnostics to stderr (`app`), the progress lines bare to stdout (`app.progress`)."""

from __future__ import annotations

import io
import logging
import sys
import warnings

log = logging.getLogger("app")


# The progress lines (`worker1 | Epoch: ...`, `Accuracy: ...`, `Time: ...`) go
# through this logger to stdout, bare; diagnostics go through `app` to stderr.
progress = logging.getLogger("app.progress")


def setup_logging(level: int = logging.INFO) -> None:
    """Bare progress lines on line-buffered stdout; timestamped diagnostics on stderr."""
    if isinstance(sys.stdout, io.TextIOWrapper):  # not a stream put in its place (a test's capture)
        sys.stdout.reconfigure(line_buffering=True)
    out = logging.StreamHandler(sys.stdout)
    out.setFormatter(logging.Formatter("%(message)s"))
    progress.handlers[:] = [out]
    progress.propagate = False
    progress.setLevel(logging.INFO)
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.handlers[:] = [err]
    # not to the root logger too: a library that configures it (mlflow.pytorch's imports do) would print it twice
    log.propagate = False
    log.setLevel(level)
    # torch's own RPC shutdown uses a deprecated ProcessGroup path; not ours to fix.
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
