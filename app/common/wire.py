"""What travels between a worker and the PS, besides tensors: the PS's answers to a push.

Both sides import these from here (RPC pickles them by this module's name): the worker
does not reach into the PS's state machine (app/ps/server.py) for its wire types.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Reply(NamedTuple):
    """The PS's answer to a push."""

    vector: torch.Tensor  # the state to continue from: [params | buffers]
    version: int  # its version
    staleness: int  # updates applied between the pusher's pull and its push
    lead: int  # pushes the pusher is ahead of the slowest rank still training


class Refusal(NamedTuple):
    """The PS's answer to a call it will not carry out (a value: RPC carries it as it is)."""

    kind: str  # "stale": a newer process replaced the caller; "nonfinite": NaN/inf pushed
    message: str  # one line, naming the worker


class SlotReply(NamedTuple):
    """The PS's answer to a push through shared memory (app.ps.exchange): the new state is in
    region `region` of the PS's segment, which the worker maps; nothing else crosses."""

    region: str  # e.g. reply1.0, round.1
    version: int
    staleness: int
    lead: int
