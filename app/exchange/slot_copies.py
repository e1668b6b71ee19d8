"""A GPU worker's message copied into its (pinned) push slot without a host wait: each piece on a
side stream once the compute stream has written it, with a flag of whether it is finite computed
on the device beside it (app.exchange.wire.finite_flag) and copied with it into pinned host
memory. The host reads a flag only once the event recorded after its copy has passed, in a thread
that waits for it (the push's sender), never in the training loop.

The message on the device is free to be written again (the next backward, the next compressed
message) once the last copy out of it has run: the compute stream waits for that event before it
writes it (`release`), so the training loop never waits for the copies itself.
"""

from __future__ import annotations

import torch

from app.exchange.wire import finite_flag


class SlotCopies:
    """Copies of device messages into `slots` (pinned host tensors), piece by piece: `pieces` are
    the [start, end) ranges a message is cut into (the partitions), each with a flag per slot."""

    def __init__(self, device: torch.device, slots: list[torch.Tensor], pieces: list[tuple[int, int]]) -> None:
        self.slots, self.pieces = slots, pieces
        self.stream = torch.cuda.Stream(device)
        # flags[slot, piece]: the piece as copied into that slot is finite (pinned: copied without a wait)
        self.flags = torch.zeros(len(slots), len(pieces), dtype=torch.bool, pin_memory=True)
        self.copied: torch.cuda.Event | None = None  # the last copy out of a device message

    def copy(self, message: torch.Tensor, slot: int, piece: int) -> torch.cuda.Event:
        """Start copying `piece` of `message` (float32, on the device) into `slot`, with its flag,
        after what the current stream has queued (what wrote it); the event of its landing."""
        start, end = self.pieces[piece]
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(message.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            values = message[start:end]
            self.flags[slot, piece].copy_(finite_flag(values), non_blocking=True)
            self.slots[slot][start:end].copy_(values, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        self.copied = landed
        return landed

    def copy_whole(self, message: torch.Tensor, slot: int) -> torch.cuda.Event:
        """Start copying all of `message` (any dtype: a --compress message is 16-bit) into `slot`,
        after what the current stream has queued; the event of its landing. No flag: the PS
        checks such a message itself."""
        view = self.slots[slot].view(message.dtype)
        if message.numel() > view.numel():
            raise ValueError(f"a message of {message.numel()} {message.dtype} values does not fit a push slot")
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(message.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            view[: message.numel()].copy_(message, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        self.copied = landed
        return landed

    def landed(self) -> torch.cuda.Event:
        """An event recorded after every copy started so far."""
        event = torch.cuda.Event()
        event.record(self.stream)
        self.copied = event
        return event

    def release(self, device: torch.device) -> None:
        """The current (compute) stream waits for the copies out of the device message before it
        writes the message again; no host wait."""
        if self.copied is not None:
            torch.cuda.current_stream(device).wait_event(self.copied)
