"""A worker's note to its PS that a partition of its next push is in its push slot: one datagram
on a Unix socket beside the PS's shared-memory segment (the same /dev/shm, so it reaches the PS
wherever the segment does).

A note is six numbers: rank, backward (which of the worker's backwards the gradient comes
from), slot, partition, the version the gradient was computed from, and the process's life at
its PS (which of the rank's joins it is: a replaced process's late note is told from the new
one's, whose backwards count from 0 again). It is only a hint:
the PS may apply the partition before the push arrives (app.ps.early); a note lost, late
or never read changes nothing but when the work is done. So the worker never waits to send one:
a full socket buffer drops it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import NamedTuple

NOTE = struct.Struct("<iqiiqi")  # rank, backward, slot, partition, version, life
SUFFIX = ".notes"
log = logging.getLogger("app.ps")


class Note(NamedTuple):
    rank: int
    backward: int
    slot: int
    partition: int
    version: int
    life: int  # which of the rank's joins at this PS the noting process is (app.exchange.wire.Joined)


class NoteInbox:
    """The PS's end: notes arrive here (`receive` waits at most `timeout` for one)."""

    def __init__(self, path: str, timeout: float = 0.5) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead PS's, at the same name: its segment is being replaced
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.settimeout(timeout)

    def receive(self) -> Note | None:
        try:
            data = self.sock.recv(NOTE.size)
        except TimeoutError:
            return None
        except OSError:  # closed
            return None
        return Note(*NOTE.unpack(data)) if len(data) == NOTE.size else None

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.sock.close()


class NoteSender:
    """A worker process's end, for rank `rank` in its life `life` at the PS: `ring` sends a
    note and never waits."""

    def __init__(self, path: str, rank: int, life: int) -> None:
        self.path, self.rank, self.life = path, rank, life
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sent = self.dropped = 0

    def note_partition(self, backward: int, slot: int, partition: int, version: int) -> None:
        """Partition `partition` of push `backward` (in `slot`, computed from `version`) is there."""
        self.send(Note(self.rank, backward, slot, partition, version, self.life))

    def send(self, note: Note) -> None:
        try:
            self.sock.sendto(NOTE.pack(*note), self.path)
            self.sent += 1
        except OSError:  # a full buffer, or no PS any more: the push itself carries the work
            self.dropped += 1

    def close(self) -> None:
        self.sock.close()


class NoteReader:
    """Reads the note socket's notes in a thread of its own and hands each to `take`, until closed."""

    def __init__(self, notes: NoteInbox, take: Callable[[Note], None]) -> None:
        self.notes, self.take = notes, take
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-notes", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            note = self.notes.receive()
            if note is None:
                continue
            try:
                self.take(note)
            except Exception as error:  # a note is a hint: the push itself carries the work
                log.debug("note %s not taken: %s", note, error)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * 0.5 + 1)
