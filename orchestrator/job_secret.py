"""A run's secret, and a local run's private exchange.

Every PS job's processes prove the run's secret before their messages are read (the app's
--secret_file, app.exchange.secret). The orchestrator makes one for each run: `make`, a 0600
file (local runs), or `new` (the text a swarm's Docker secret or a Kubernetes Secret holds).

A local run's processes also talk over UNIX sockets in a directory of their own
(`private_exchange`): 0700, so the kernel refuses every other account before a byte is read.
It lives under the system's temporary directory (a socket's path must be short) and goes,
with the secret, when the run ends. Its name carries the launcher's PID (`psc-<pid>-*`): one a
killed launcher left is removed by the next run of any name (`remove_stale_sockets`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app.option_table import BY_NAME
from orchestrator.pids import alive

SECRET_BYTES = 32  # as app.exchange.secret makes them
SECRET_FILE = "secret"  # in the run's directory
SECRET_ENV = BY_NAME["secret_file"].env
SOCKET_DIR_ENV = BY_NAME["socket_dir"].env


def new() -> str:
    """A new secret, as text (hex)."""
    return secrets.token_hex(SECRET_BYTES)


def make(path: Path) -> Path:
    """A new secret in `path`, 0600 from its creation (one left by an earlier run is replaced whole)."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # a temp file a killed launcher left, with another mode
    with os.fdopen(descriptor, "w") as out:
        out.write(new() + "\n")
    os.replace(temp, path)
    return path


@contextmanager
def private_exchange(run_dir: Path) -> Iterator[dict[str, str]]:
    """The environment that gives a local run's processes its secret (run_dir/secret) and its
    socket directory, both removed when the run ends."""
    secret = make(run_dir / SECRET_FILE)
    remove_stale_sockets(Path(tempfile.gettempdir()))
    sockets = tempfile.mkdtemp(prefix=f"psc-{os.getpid()}-")  # 0700
    try:
        yield {SECRET_ENV: str(secret.resolve()), SOCKET_DIR_ENV: sockets}
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
        secret.unlink(missing_ok=True)


def remove_stale_sockets(root: Path) -> list[Path]:
    """The socket directories under `root` that a killed launcher of this account left (its PID,
    in the name, is gone), removed. Another account's, a link, or a live launcher's stay."""
    stale = []
    for path in root.glob("psc-*-*"):
        found = re.fullmatch(r"psc-(\d+)-\w+", path.name)
        if found is None or alive(int(found[1])):
            continue
        try:
            info = path.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            stale.append(path)
    return stale
