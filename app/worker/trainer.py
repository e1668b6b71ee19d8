"""A worker: pull parameters, forward, backward, push the flat gradient, receive
fresh parameters; on its own shard of the data, for its epochs.

With --overlap (async, ssp) the push of batch t and the pull of the fresh
state travel while batch t+1 runs on the state the worker has; with
--compress bf16|fp16 the gradient crosses the wire in 16 bits and what the
rounding lost is added to the next gradient (error feedback); the buffers
(BatchNorm running stats) cross in float32.

A push the PS refuses because it holds NaN or inf changes nothing: the worker
counts it, keeps its state and goes on with the next batch; after
MAX_REFUSED_IN_A_ROW refusals in a row it gives up (exit 1, one line: the
training diverged). A refusal because a newer process replaced this one ends
the worker with exit 2.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from app import runtime
from app.config import Config
from app.data import datasets
from app.exchange.early_push import DevicePoster, Poster
from app.exchange.layout import cut
from app.exchange.notes import NoteSender
from app.exchange.ordered_pull import DevicePuller
from app.exchange.wire import Refusal, Reply, Start, Version
from app.training import loop
from app.training.flat import FlatModel
from app.training.metrics import MetricsWriter
from app.worker.client import Pending, PSClient
from app.worker.compress import Compressor
from app.worker.sharded_client import ShardedClient

log = logging.getLogger("app.worker")
MAX_REFUSED_IN_A_ROW = 20


class Trainer:
    """The training loop of one worker; `train()` returns the number of pushes."""

    def __init__(
        self,
        config: Config,
        model: nn.Module,
        loader: torch.utils.data.DataLoader,
        sampler: datasets.ShardSampler,
        device: torch.device,
        client: PSClient | ShardedClient,
        metrics: MetricsWriter,
    ) -> None:
        self.config, self.model, self.loader, self.sampler = config, model, loader, sampler
        self.device, self.client, self.metrics = device, client, metrics
        self.flat = FlatModel(model, own_buffers=True)
        self.loss_fn = nn.CrossEntropyLoss()
        self.format = runtime.memory_format(config, device)
        # fp16 (CUDA only): the loss is scaled before backward and the gradient unscaled
        # after it; a batch whose gradient overflowed is not pushed, and the scale halves.
        # The scaler needs an optimizer to unscale through: a local one, never stepped.
        self.scaler = torch.amp.GradScaler("cuda") if config.precision == "fp16" else None
        self._unscaler = torch.optim.SGD(model.parameters(), lr=0.0) if self.scaler else None
        self.skipped = 0  # fp16: batches not pushed (gradient overflow)
        self.compress = Compressor(config.compress, self.flat.num_params, device) if config.compress != "none" else None
        wire_dtype = self.compress.dtype if self.compress else torch.float32
        # RPC carries CPU tensors only: a GPU worker that pushes over TensorPipe stages its
        # message here (two buffers, used by pushes sent in turn: with --overlap one is on
        # the wire while the next fills); through shared memory it copies into a push slot.
        wire_size = self.flat.size + (self.flat.num_buffers if self.compress else 0)
        self.staging = (
            [torch.empty(wire_size, dtype=wire_dtype, pin_memory=True) for _ in range(2)]
            if device.type == "cuda"
            else None
        )
        self.in_flight: Pending | None = None  # --overlap: the push on the wire
        self.slots: list[torch.Tensor] | None = None  # the push slots in the PS's shared memory, once joined
        self.poster: Poster | None = None  # notes partitions as the backward finishes them (app.exchange.early_push)
        self.puller: DevicePuller | None = None  # a GPU worker's partitions back, in forward order
        self.backwards = 0  # backwards run by this process: which one a push's gradient comes from
        self._claimed = False  # the last backward's notes hold
        self.version: Version = 0  # of the state this worker computes on (a tuple over PS shards)
        self.pushes = 0  # pushes answered (this process and the rank's earlier ones)
        self.sent = 0  # pushes sent by this process
        self.refused = 0  # pushes the PS refused (non-finite values)
        self._refused_in_a_row = 0
        self.reporter = loop.Reporter(config.name, config.log_every, metrics)
        # A job that may be scaled while it runs (--max_workers): each epoch's share of the data
        # is taken among the ranks training at its start (not with a stable shard: the image cache).
        self.reshards = config.max_trainers > config.num_trainers and not sampler.fixed

    def train(self, start: Start) -> int:
        """From where the rank is (`start`: the PS's answer to join) to its last epoch."""
        self.model.train()
        self.start_from(start)
        for epoch, batch, x, y in loop.resume_batches(
            self.loader,
            self.sampler,
            self.config.data_dir,
            start.progress.epoch,
            start.progress.batch,
            self.config.num_epochs,
            self.config.batch_size,
            before_epoch=self.reshard if self.reshards else None,
        ):
            loss = self.compute_gradients(x, y)
            if loss is None:  # fp16: the gradient overflowed; the scale is halved
                continue
            reply = self.push_and_pull(epoch, batch, len(y))
            fields = {"staleness": reply.staleness, "lead": reply.lead} if reply is not None else {}
            self.reporter.batch_done(self.loader, self.pushes, epoch, batch, len(y), loss, **fields)
            if self.reached_max_steps():
                break
        return self.last_reply()

    def start_from(self, start: Start) -> None:
        """Take the PS's answer to join: the state, its version, the rank's pushes; and, when the
        client reaches the PS through shared memory, write messages into its push slots."""
        self.flat.adopt(start.vector)
        self.version, self.pushes = start.version, start.progress.pushes
        self.slots = self.client.message_buffers()
        if self.device.type == "cpu":  # the model is pointed at the PS's reply buffers: their views once
            self.flat.keep_views_of(self.client.reply_buffers())
        if self.slots is not None and self.device.type == "cpu" and self.compress is None:
            self.flat.keep_views_of(self.slots)
            self.flat.use_messages(self.slots)  # backward writes the gradient where the PS reads it
        self.poster = self._poster()
        self.puller = self._puller()

    def _puller(self) -> DevicePuller | None:
        """A GPU worker through shared memory takes each reply back partition by partition, in
        the order its forward needs them (app.exchange.ordered_pull)."""
        link = getattr(self.client, "link", None)
        if link is None or self.device.type != "cuda":
            return None
        parts = link.parts or cut([p.numel() for p in self.model.parameters()], self.flat.size)
        return DevicePuller(self.model, self.flat, parts)

    def _poster(self) -> Poster | None:
        """A Poster where the PS applies partitions ahead and this worker can hand them over as
        its backward finishes them: through shared memory, float32 on the wire, no fp16 loss
        scaling (its gradient is final only once unscaled after the backward)."""
        link = getattr(self.client, "link", None)
        if link is None or not link.parts or self.compress is not None or self.scaler is not None:
            return None
        params = list(self.model.parameters())
        sender = NoteSender(link.notes, self.config.rank, link.life)
        if self.device.type == "cpu":
            return Poster(params, link.parts, sender, self.config.name, link.slots)
        return DevicePoster(params, link.parts, sender, self.config.name, self.flat, link.slots)

    def reshard(self, epoch: int) -> None:
        """Take this rank's fair share of `epoch` among the ranks the PS has training now."""
        index, count = self.client.shard()
        if (index, count) != (self.sampler.shard, self.sampler.num_shards):
            log.info("%s: epoch %d shared by %d workers; share %d is this one", self.config.name, epoch, count, index)
        self.sampler.shard, self.sampler.num_shards = index, count

    def compute_gradients(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward (under --precision's autocast) and backward; the float32 gradient lands in
        self.flat.grads. None when fp16's gradient overflowed (nothing to push)."""
        x, y = loop.on_device(x, y, self.loader, self.device, self.format)
        if self.poster is not None:
            assert isinstance(self.version, int)  # notes go to one PS process
            self.poster.arm(self.backwards, self._slot(), self.version)
        self.backwards += 1
        with self.flat.writing_grads():  # each gradient written into the message once
            with runtime.autocast(self.config.precision, self.device):
                loss = self.loss_fn(self.model(x), y)
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if self.scaler is None:
            self._claimed = self.poster is not None and self.poster.claims()
            return loss.item()
        assert self._unscaler is not None  # made with the scaler
        self.scaler.unscale_(self._unscaler)
        overflow = sum(v.item() for v in self.scaler._found_inf_per_device(self._unscaler).values())
        self.scaler.update()
        if overflow:
            self.skipped += 1
            return None
        return loss.item()

    def push_and_pull(self, epoch: int = 1, batch: int = 0, samples: int = 0) -> Reply | None:
        """Send [grads | buffers] as one tensor (and where this worker is: `batch` of
        `epoch` done); continue from the fresh state the PS answers.

        With --overlap, the reply waited for is the previous push's, and this push
        stays on the wire while the next batch runs; None on the first push.
        """
        message = self.flat.pack_message()
        if self.compress is not None:
            message = self.compress(message)
        if self.staging is not None and self.slots is None:  # over TensorPipe:
            message = self.staging[self.sent % 2].copy_(message)  # the other buffer may still be on the wire
        elif self.config.overlap and message is self.flat.message and self.device.type == "cpu":
            self.flat.flip()  # the next backward writes into the other buffer, not the one sent
        ahead = self._ahead()
        self.sent += 1
        computed_on = self.version  # the state this gradient comes from, before the reply below
        reply = self._wait_in_flight() if self.config.overlap else None
        with runtime.sigterm_deferred():  # a push sent is one on record: SIGTERM's leave waits for it
            self.in_flight = self.client.push_async(message, computed_on, epoch, batch, samples, **ahead)
        return reply if self.config.overlap else self._wait_in_flight()

    def _ahead(self) -> dict[str, Any]:
        """What the push says of the partitions noted during its backward (app.exchange.early_push):
        the backward it comes from and whether its notes hold, and the slot a GPU worker copied
        the message into; nothing where this worker notes none."""
        if self.poster is None:
            return {}
        placed = self.poster.finish() if isinstance(self.poster, DevicePoster) else None
        return {"noted": (self.backwards - 1, self._claimed), "placed": placed}

    def _slot(self) -> int:
        """The push slot the next backward's gradient goes into: the one the gradients are
        views of (CPU), or the next one taken (GPU)."""
        assert self.slots is not None
        if self.device.type != "cpu":
            link = getattr(self.client, "link", None)
            assert link is not None  # push slots come with the link
            return link.reserve()
        return next(k for k, slot in enumerate(self.slots) if slot.data_ptr() == self.flat.message.data_ptr())

    def last_reply(self) -> int:
        """The end of training: take the reply still on the wire (--overlap's, or the push a
        SIGTERM came after); the pushes made."""
        self._wait_in_flight()
        return self.pushes

    def _wait_in_flight(self) -> Reply | None:
        pending, self.in_flight = self.in_flight, None
        return self._take(pending.wait()) if pending is not None else None

    def _take(self, reply: Reply | Refusal) -> Reply | None:
        """Continue from the reply's state; a refused push (non-finite) is skipped: None."""
        if isinstance(reply, Refusal):
            self._skip(reply)
            return None
        self._refused_in_a_row = 0
        if self.puller is not None:  # a GPU worker: copied to the device as its forward needs it
            self.puller.load(reply.vector)
        else:  # no copy: a received tensor, or the PS's reply buffer in shared memory
            self.flat.adopt(reply.vector)
        self.version = reply.version
        self.pushes += 1
        return reply

    def _skip(self, refusal: Refusal) -> None:
        self.refused += 1
        self._refused_in_a_row += 1
        if self._refused_in_a_row >= MAX_REFUSED_IN_A_ROW:
            raise RuntimeError(
                f"{self._refused_in_a_row} pushes in a row were refused ({refusal.message}): "
                "training diverged; try a lower --lr"
            )
        if self.refused == 1:
            log.warning("%s; skipping that batch (refusals are counted in the metrics)", refusal.message)
        if self.metrics is not None:
            self.metrics.write("refused", self.pushes, refused=self.refused)
        return None

    def reached_max_steps(self) -> bool:
        sent = self.pushes + (self.in_flight is not None)
        return 0 < self.config.max_steps <= sent
