"""The run's secret, and what every process of the job derives from it to prove it is one of them.

A secret is made for each run as it starts (`make`: 32 random bytes, hex, a 0600 file) and reaches
only the job's processes (local: the run's directory; compose: a secret file only its containers
mount; swarm: a Docker secret). Each process reads it (`read`) and derives the same `Credentials`:

- for CURVE (TCP, encrypted): the server's key pair and the clients' key pair, each a Curve25519
  secret key hashed from the secret; a server admits only the clients' public key, and a client
  trusts only the server's, so both ends prove they hold the secret before any message is read;
- for PLAIN (a UNIX socket, or TCP with encryption turned off): a password hashed from the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import NamedTuple

import zmq
from zmq.utils import z85

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16  # a secret file written by hand: at least this many bytes (hex: twice as many characters)
USER = b"psc"


class Credentials(NamedTuple):
    """What one process of the job holds: the server's and the clients' CURVE keys (Z85), the
    PLAIN password. Never logged, never sent: only the libzmq handshake uses them."""

    server_secret: bytes
    server_public: bytes
    client_secret: bytes
    client_public: bytes
    password: bytes


def make(path: str | Path) -> Path:
    """A new secret in `path` (0600 from its creation; replaced whole if one is there)."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(secrets.token_hex(SECRET_BYTES) + "\n")
    os.replace(temp, path)
    return path


def read(path: str | Path) -> bytes:
    """The secret in `path`; ValueError (one line) when it cannot be read or is too short to be one."""
    try:
        text = Path(path).read_bytes().strip()
    except OSError as error:
        raise ValueError(f"cannot read the run's secret {path}: {error.strerror or error}") from None
    if len(text) < 2 * MIN_SECRET_BYTES:
        raise ValueError(
            f"the run's secret {path} holds {len(text)} bytes; at least {2 * MIN_SECRET_BYTES} are needed "
            f"(e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > {path}`)"
        )
    return text


def derive(secret: bytes) -> Credentials:
    """The job's credentials, the same in every process that holds `secret`."""
    server_secret = z85.encode(_hashed(secret, b"curve-server"))
    client_secret = z85.encode(_hashed(secret, b"curve-client"))
    return Credentials(
        server_secret,
        zmq.curve_public(server_secret),
        client_secret,
        zmq.curve_public(client_secret),
        _hashed(secret, b"plain").hex().encode(),
    )


def _hashed(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"ps-compose " + purpose, hashlib.sha256).digest()
