"""A worker: pull parameters, forward, backward, push the flat gradient, receive
fresh parameters; on its own shard of the data, for its epochs.

With --overlap (async, ssp) the push of batch t and the pull of the fresh
state travel while batch t+1 runs on the state the worker has; with
--compress bf16|fp16 the gradient crosses the wire in 16 bits and what the
rounding lost is added to the next gradient (error feedback); the buffers
(BatchNorm running stats) cross in float32.

Under diloco and diloco_async each batch steps the worker's own optimizer, and a push, every
train.local_steps batches and after the last, carries the change of the parameters since the
last pull instead of a gradient (app.worker.local_steps).

A push the PS refuses because it holds NaN or inf changes nothing: the worker
counts it, keeps its state and goes on with the next batch; after
MAX_REFUSED_IN_A_ROW refusals in a row it gives up (exit 1, one line: the
training diverged). A refusal because a newer process replaced this one ends
the worker with exit 2.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from app.config import Config
from app.contract import strategy_of
from app.data import datasets
from app.data.streams import StreamSampler
from app.exchange.route import Pending, Route
from app.exchange.wire import Refusal, Reply, Start, Version
from app.runtime import devices, lifecycle
from app.training import loop, losses
from app.training.flat import FlatModel
from app.training.metrics import MetricsWriter
from app.worker import graphed
from app.worker.channels import Channel
from app.worker.compress import Compressor
from app.worker.local_steps import LocalSteps

log = logging.getLogger("app.worker")
MAX_REFUSED_IN_A_ROW = 20


class Trainer:
    """The training loop of one worker; `train()` returns the number of pushes."""

    def __init__(
        self,
        config: Config,
        model: nn.Module,
        loader: torch.utils.data.DataLoader,
        sampler: datasets.ShardSampler | StreamSampler,
        device: torch.device,
        channel: Channel,
        metrics: MetricsWriter,
    ) -> None:
        self.config, self.model, self.loader, self.sampler = config, model, loader, sampler
        self.device, self.channel, self.metrics = device, channel, metrics
        self.flat = FlatModel(model, own_buffers=True)
        self.loss_fn = losses.build(config.loss)
        # train.clip_grad_norm: the gradient's norm, computed on the device, travels with the push
        # (on a GPU through a pinned scalar, copied before the push's `ready` event: no host wait).
        # Two, used in turn: with --overlap one push is on the wire while the next one's is taken.
        self.norm_host = torch.empty(2, pin_memory=True) if config.clip_grad_norm and device.type == "cuda" else None
        self.epoch_batches = loop.epoch_batches(loader, config.batch_size)
        self.stream = isinstance(sampler, StreamSampler)  # its loader's length is the pass's, not the share's
        self.format = devices.memory_format(config, device)
        # fp16 (CUDA only): the loss is scaled before backward and the gradient unscaled
        # after it; a batch whose gradient overflowed is not pushed, and the scale halves.
        # The scaler needs an optimizer to unscale through: a local one, never stepped.
        self.scaler = torch.amp.GradScaler("cuda") if config.precision == "fp16" else None
        self._unscaler = torch.optim.SGD(model.parameters(), lr=0.0) if self.scaler else None
        self.skipped = 0  # fp16: batches not pushed (gradient overflow)
        self.compress = Compressor(config.compress, self.flat.num_params, device) if config.compress != "none" else None
        # train.cuda_graphs (a GPU worker): the step's forward and backward replayed as a CUDA graph.
        self.graphed = graphed.for_worker(config, model, self.flat, self.loss_fn, device)
        self.route: Route  # the way each step reaches the PS: the channel's, once joined (`start_from`)
        self.in_flight: Pending | None = None  # --overlap: the push on the wire
        self.version: Version = 0  # of the state this worker computes on (a tuple over PS shards)
        self.pushes = 0  # pushes answered (this process and the rank's earlier ones)
        self.sent = 0  # pushes sent by this process
        self.refused = 0  # pushes the PS refused (non-finite values)
        self._refused_in_a_row = 0
        self.reporter = loop.Reporter(config.name, config.log_every, metrics)
        self.losses = loop.Losses(device)
        # A job that may be scaled while it runs (--max_workers): the PS hands out each epoch's
        # data in shares, each trained once (not with a stable shard: the image cache).
        self.reshards = config.max_trainers > config.num_trainers and not sampler.fixed
        self.on_device = loop.device_batches(self.loader, device, self.format)
        self.local = LocalSteps(config, model, self.flat) if strategy_of(config.strategy).local else None
        self.at = (1, 0)  # the epoch and batch of the last batch trained

    def train(self, start: Start) -> int:
        """From where the rank is (`start`: the PS's answer to join) to its last epoch."""
        self.model.train()
        self.start_from(start)
        batches = loop.resume_batches(
            self.loader,
            self.sampler,
            self.config.data_dir,
            start.progress.epoch,
            start.progress.batch,
            self.config.epochs,
            self.config.batch_size,
            on_device=self.on_device,
        )
        for epoch, batch, x, y in self.shares() if self.reshards else batches:
            loss = self.compute_gradients(x, y)
            if loss is None:  # fp16: the gradient overflowed; the scale is halved
                continue
            self.at = (epoch, batch)
            reply = self.push_and_pull(epoch, batch, len(y)) if self.due(len(y)) else None
            fields = {"staleness": reply.staleness, "lead": reply.lead} if reply is not None else {}
            self.reporter.batch_done(self.loader, self.trained(), epoch, batch, len(y), loss, **fields)
            if self.reached_max_steps():
                break
        return self.last_reply()

    def start_from(self, start: Start) -> None:
        """Take the PS's answer to join: the state, its version, the rank's pushes; the channel's
        route points the model where it exchanges its state and gradient. A GPU worker's gradient may be
        copied out as the backward finishes each partition only where it is final then (no fp16
        loss scaling, no --compress, no CUDA graph: no hook runs in a replay); messages go into
        the route's buffers where they are float32. With a CUDA graph each reply is loaded
        whole, before the step."""
        self.version, self.pushes = start.version, start.progress.pushes
        hooks = self.graphed is None
        final = self.compress is None and self.scaler is None and hooks
        messages_here = self.compress is None
        self.route = self.channel.route
        if self.local is not None:  # its parameters are stepped here: each answer is copied into them, whole
            hooks = final = False
        self.route.bind(self.model, self.flat, start, final=final, messages_here=messages_here, ordered=hooks)
        if self.local is not None:
            self.local.restart(start.progress.pushes * self.config.local_steps, self.planned_steps())

    def shares(self) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(epoch, batch, x, y) of each share of an epoch the PS hands this rank, until none is left
        (a job that may be scaled: app.ps.members.epochs). A share's pushes are all answered
        before the next is asked for: the PS counts its batches done by them."""
        share = self.channel.share(None)
        while share is not None:
            if (share.shard, share.num_shards) != (self.sampler.shard, self.sampler.num_shards) or share.skip:
                after = f", from batch {share.skip + 1}" if share.skip else ""
                which = (share.shard + 1, share.num_shards)
                log.info("%s: epoch %d, share %d of %d%s", self.config.name, share.epoch, *which, after)
            self.sampler.shard, self.sampler.num_shards = share.shard, share.num_shards
            self.sampler.set_epoch(share.epoch, skip=share.skip * self.config.batch_size)
            epoch = self.on_device(datasets.batches(self.loader, self.config.data_dir))
            for batch, (x, y) in enumerate(epoch, start=share.skip + 1):
                yield share.epoch, batch, x, y
            self.push_rest()
            self._wait_in_flight()
            share = self.channel.share(share)

    def compute_gradients(self, x: torch.Tensor, y: torch.Tensor) -> loop.Loss | None:
        """Forward (under --precision's autocast) and backward of a batch already on the device;
        the float32 gradient lands in self.flat.grads (app.training.flat.FlatModel.writing_grads).
        The loss as the host will read it, without waiting for the GPU; None when fp16's
        gradient overflowed (nothing to push). With --cuda_graphs a batch of the captured shape
        replays the graph (app.worker.graphed)."""
        if self.graphed is not None and self.graphed.fits(x, y):
            with self.route.backward():
                return self.losses.take(self.graphed.step(x, y))
        with self.route.backward(), self.flat.writing_grads():
            with devices.autocast(self.config.precision, self.device):
                loss = self.loss_fn(self.model(x), y)
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if self.scaler is None:
            return self.losses.take(loss)
        assert self._unscaler is not None  # made with the scaler
        self.scaler.unscale_(self._unscaler)
        # A wait the data needs: whether fp16's gradient overflowed decides whether there is a push.
        overflow = sum(v.item() for v in self.scaler._found_inf_per_device(self._unscaler).values())
        self.scaler.update()
        if overflow:
            self.skipped += 1
            return None
        return self.losses.take(loss)

    def due(self, samples: int) -> bool:
        """Whether this batch (of `samples`) is pushed: each one, or under a local strategy the
        step of the worker's own optimizer, and every train.local_steps of them."""
        return self.local is None or self.local.step(samples)

    def trained(self) -> int:
        """The rank's steps: its pushes, or under a local strategy its batches."""
        return self.pushes if self.local is None else self.local.steps

    def planned_steps(self) -> int:
        """A local strategy's schedule spans the rank's batches: its share of every epoch's, or
        train.max_steps; 0 where neither is known."""
        share = self.config.epochs * -(-self.epoch_batches // max(1, self.config.num_trainers))
        if self.config.max_steps:
            return min(share, self.config.max_steps) if share else self.config.max_steps
        return share

    def push_rest(self) -> None:
        """A local strategy: push the steps taken since the last push (a share's or the run's last)."""
        if self.local is not None and self.local.pending:
            self.push_and_pull(*self.at, 0)

    def push_and_pull(self, epoch: int = 1, batch: int = 0, samples: int = 0) -> Reply | None:
        """Send [grads | buffers] as one tensor (and where this worker is: `batch` of
        `epoch` done); continue from the fresh state the PS answers. Under a local strategy
        the grads are the change since the last pull, and `samples` all its batches'.

        With --overlap, the reply waited for is the previous push's, and this push
        stays on the wire while the next batch runs; None on the first push.
        """
        norm = self.grad_norm()
        if self.local is not None:
            self.local.change()
            samples = self.local.samples
        message = self.flat.pack_message()
        # a CPU backward proved its gradient finite as it wrote it: the PS need not check it again
        proof = self.flat.finite_proof() if self.local is None and self.compress is None else None
        if self.compress is not None:
            message = self.compress(message)
        outgoing = self.route.seal(message)  # on a GPU its copies to the host are queued, not waited for
        if proof is not None and outgoing.flags is None:
            outgoing = outgoing._replace(flags=proof)
        if norm is not None:
            outgoing = outgoing._replace(norm=norm)
        report = self.reporter.take()  # the progress line's loss and samples/s, for the PS's tracker
        if report is not None:
            outgoing = outgoing._replace(report=report)
        computed_on = self.version  # the state this gradient comes from, before the reply below
        # A wait the data needs (--overlap): the next batch computes on the state of the previous
        # push's reply; on a GPU this one's backward is still running meanwhile.
        reply = self._wait_in_flight() if self.config.overlap else None
        with lifecycle.sigterm_deferred():  # a push sent is one on record: SIGTERM's leave waits for it
            to_go = self.to_go(epoch, batch)
            self.in_flight = self.route.push(outgoing, computed_on, epoch, batch, samples, to_go, self.epoch_batches)
        # A wait the data needs (no --overlap): the next batch computes on this push's reply.
        return reply if self.config.overlap else self._wait_in_flight()

    def grad_norm(self) -> torch.Tensor | None:
        """train.clip_grad_norm: the global L2 norm of this batch's gradient (before --compress),
        as torch.nn.utils.clip_grad_norm_ takes it; None without clipping. On a GPU a pinned host
        copy, queued on the compute stream: it has landed once the push's copies have."""
        if not self.config.clip_grad_norm or self.local is not None:  # a local strategy clips each step
            return None
        norm = torch.linalg.vector_norm(self.flat.grads)
        if self.norm_host is None:
            return norm
        host = self.norm_host[self.sent % 2]
        host.copy_(norm, non_blocking=True)
        return host

    def last_reply(self) -> int:
        """The end of training: take the reply still on the wire (--overlap's, or the push a
        SIGTERM came after), and the change of a local strategy's last steps; write the report
        that waited for its loss; the pushes made."""
        self._wait_in_flight()
        self.push_rest()
        self.reporter.flush()
        return self.pushes

    def _wait_in_flight(self) -> Reply | None:
        pending, self.in_flight = self.in_flight, None
        return self._take(pending.wait()) if pending is not None else None

    def _take(self, reply: Reply | Refusal) -> Reply | None:
        """Continue from the reply's state (the wait made it the model's); a refused push
        (non-finite) is skipped: None."""
        if isinstance(reply, Refusal):
            if self.local is not None:
                self.local.refused()
            self._skip(reply)
            return None
        if self.local is not None:
            self.local.pulled()
        self._refused_in_a_row = 0
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

    def to_go(self, epoch: int, batch: int) -> int:
        """The pushes this rank has still to make after the one of `batch` of `epoch`, as planned
        now: the rest of its epochs' batches, at most --max_steps in all (the PS adds them up into
        the run's total updates); under a local strategy one every train.local_steps of those
        batches. -1 where it cannot be known: a job that may be scaled (the PS hands out each
        epoch's shares as it goes), or a loader without a length; a stream's: what --max_steps
        leaves (it may end sooner, at its last pass)."""
        done = self.pushes + 1 if self.local is None else self.local.steps  # this push's batch included
        if self.stream and self.config.max_steps > 0 and not self.reshards:  # its share's length is not known
            left = self.config.max_steps - done
        elif self.reshards or self.stream:
            return -1
        else:
            try:
                per_epoch = len(self.loader)
            except TypeError:  # an iterable dataset of the user's own
                return -1
            left = per_epoch - batch + (self.config.epochs - epoch) * per_epoch
            if self.config.max_steps > 0:
                left = min(left, self.config.max_steps - done)
        return max(0, left) if self.local is None else self.local.pushes_for(left)

    def reached_max_steps(self) -> bool:
        if self.local is not None:
            return 0 < self.config.max_steps <= self.local.steps
        sent = self.pushes + (self.in_flight is not None)
        return 0 < self.config.max_steps <= sent
