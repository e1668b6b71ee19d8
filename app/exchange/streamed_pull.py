"""A CPU worker reads a streamed reply as its PS writes it: the PS answers a plain async push as
soon as the first partition of the new state is written (app.ps.state's `step_streamed`), and
writes the others in the order the forward reads them, raising the region's word after each
(app.exchange.progress). Before the forward reaches a module, it waits until the word says the
partitions that module's parameters are in are written (the float buffers are written before
the first partition), so the first layers compute while the PS still writes the last ones: the
step is compute plus the first partition's update, not plus the whole update.

The modules and the order they run in are found as app.exchange.ordered_pull finds them for a
GPU worker's copies: the first forward records the order, and from then on one hook per
partition waits, on the module that needs it first (while a streamed reply is read: none runs
for a reply that came whole). A module no forward ran waits for all it needs. After the
backward (`settle`) the worker waits for whatever is left, so nothing of the reply is ever read
unwritten. A PS that ended before it wrote a partition (`alive`: its segment's owner is gone) is
found out within a second, not at the timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch import nn

from app.exchange import progress
from app.exchange.ordered_pull import ForwardWaits
from app.exchange.route import PSUnreachable

CHECK_EVERY = 1.0  # seconds a forward waits for a partition before it asks whether its PS still lives


class StreamedPull(ForwardWaits):
    """The forward's waits for the partitions `parts` of a streamed reply."""

    def __init__(
        self,
        model: nn.Module,
        parts: list[tuple[int, int]],
        timeout: float,
        peer: str,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        super().__init__(model, parts)
        self.parts, self.timeout, self.peer, self.alive = parts, timeout, peer, alive
        self.address: int | None = None  # the word of the reply being written; None: it is whole
        self.base = 0  # the word's count before it
        self.written = 0  # its partitions known written

    def expect(self, address: int, base: int) -> None:
        """The reply now read is written partition by partition: its word, and its count before."""
        self.arm()
        self.address, self.base, self.written = address, base, 0

    def whole(self) -> None:
        """The reply now read was written whole before its answer went: no hook waits."""
        self.disarm()
        self.address = None

    def settle(self) -> None:
        """Wait for every partition of the reply (before anything but the forward reads it)."""
        self._need(len(self.parts))
        self.address = None

    def _wait_for(self, copies: list[int]) -> None:
        if self.address is not None:  # the buffers are written with the first partition
            self._need(max(max(j, 0) for j in copies) + 1)

    def _need(self, count: int) -> None:
        if self.address is None or count <= self.written:
            return
        deadline = time.monotonic() + self.timeout
        while not progress.wait_until(self.address, self.base, count, min(CHECK_EVERY, self.timeout)):
            if not self.alive():
                raise PSUnreachable(f"parameter server process {self.peer} ended while it wrote its answer")
            if time.monotonic() >= deadline:
                raise PSUnreachable(
                    f"parameter server process {self.peer} wrote {self.written} of the {len(self.parts)} "
                    f"partitions of its answer, not the {count}th within {self.timeout:.0f} s"
                )
        self.written = count
