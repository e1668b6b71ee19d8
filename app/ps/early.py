"""A push's partitions taken early: as the worker's backward finishes them, before the push arrives.

A worker on the PS's host notes on the PS's note socket (app.exchange.notes) each partition of its
gradient that is complete in its push slot (app.exchange.early_push); the PS's note reader (a
thread) hands each note to the server (`ParameterServer.note`), which hands it, under its lock,
to the strategy's policy (app.ps.policies):

- sync folds the partition into the open round at once (app.ps.policies.rounds): the round's
  work is done while the backwards still run, and the push folds what is left;
- async with plain SGD builds the partition of the next state in the rank's next reply
  buffer (the one the worker is not computing on), from the state as it is, and records the
  version it read. When the push arrives, a partition built from that very version is kept;
  one built before another push moved the state is built again. The push is still one update,
  applied whole or refused whole (a NaN anywhere refuses it: nothing built early is the state
  until the push is taken).

A note is only a hint: one that is late (its push already taken), stale (an older backward, a
rank's old process) or lost changes when the work is done, never what it computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class EarlyPartitions:
    """The partitions of one rank's push from backward `backward`, in slot `slot`, that were
    noted before the push (`noted`: their worker found them finite, app.exchange.early_push),
    and those built early into reply buffer `into` (partition -> the version it was built from)."""

    backward: int
    slot: int
    into: torch.Tensor
    built: dict[int, int] = field(default_factory=dict)
    noted: set[int] = field(default_factory=set)
