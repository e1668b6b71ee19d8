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
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from app import data, membership, models, ps, runtime, shards
from app.config import Config, UsageError
from app.flat import FlatModel
from app.metrics import MetricsWriter
from app.runtime import choose_device, first_line, gpu_identity, progress, rpc_session

log = logging.getLogger("app.worker")
PS_NAME = "ps"
POLL_SECONDS = 0.5
MAX_REFUSED_IN_A_ROW = 20


class PSUnreachable(RuntimeError):
    """A call to the PS failed (it died, or did not answer within rpc_timeout)."""


class PSClient:
    """The worker's side of the PS's RPC functions; every call bounded by rpc_timeout
    (a push under ssp or sync may also wait `push_wait` for the slowest worker)."""

    def __init__(self, rank: int, timeout: float, address: str, name: str = "",
                 push_wait: float = 0.0) -> None:
        self.rank, self.timeout, self.address = rank, timeout, address
        self.name = name or f"worker{rank}"
        self.push_timeout = timeout + push_wait

    def join(self) -> dict[str, Any]:
        """The state to start from and this rank's progress; UsageError if the rank is taken."""
        answer = self._call(ps.rpc_join, self.rank, self.name)
        if "taken" in answer:
            raise UsageError(answer["taken"])
        return answer

    def pull(self) -> tuple[torch.Tensor, int]:
        return self._call(ps.rpc_pull, self.rank)

    def push(self, message: torch.Tensor, version: int, epoch: int = 1, batch: int = 0,
             samples: int = 0) -> ps.Reply:
        return self.push_async(message, version, epoch, batch, samples).wait()

    def push_async(self, message: torch.Tensor, version: int, epoch: int = 1, batch: int = 0,
                   samples: int = 0) -> "PendingPush":
        """Send a push now; `.wait()` on the result gives the Reply."""
        args = (self.rank, message, version, self.name, epoch, batch, samples)
        try:
            future = rpc.rpc_async(PS_NAME, ps.rpc_push, args=args, timeout=self.push_timeout)
        except RuntimeError as error:
            raise self._lost(ps.rpc_push, error) from error
        return PendingPush(self, future, message)

    def finish(self, pushes: int) -> None:
        refused(self._call(ps.rpc_finish, self.rank, pushes, self.name))

    def wait_all_finished(self) -> None:
        """Poll until every worker is done (the app's workers leave without waiting)."""
        while not self._call(ps.rpc_all_finished):
            time.sleep(POLL_SECONDS)

    def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return rpc.rpc_sync(PS_NAME, function, args=args, timeout=self.timeout)
        except RuntimeError as error:
            raise self._lost(function, error) from error

    def _lost(self, function: Callable[..., Any], error: BaseException) -> PSUnreachable:
        return PSUnreachable(f"lost the parameter server at {self.address} "
                             f"during {function.__name__}: {first_line(error)}")


def refused(answer: Any) -> Any:
    """The PS's answer, unless it refused because a newer process replaced this one
    (UsageError: exit 2); a `nonfinite` Refusal is returned for the caller to skip."""
    if isinstance(answer, ps.Refusal) and answer.kind == "stale":
        raise UsageError(answer.message)
    return answer


class PendingPush:
    """A push on the wire; holds its message until the reply came (RPC sends from it)."""

    def __init__(self, client: PSClient, future: Any, message: torch.Tensor) -> None:
        self.client, self.future, self.message = client, future, message

    def wait(self) -> ps.Reply | ps.Refusal:
        try:
            answer = self.future.wait()
        except RuntimeError as error:
            raise self.client._lost(ps.rpc_push, error) from error
        return refused(answer)


class Compressor:
    """The message for the wire as one 16-bit tensor: the gradients cast to bf16/fp16
    (their rounding error is kept and added to the next gradient: error feedback),
    then the float32 buffers bit for bit, each as two 16-bit values (the PS reads
    them back: ParameterServer._check)."""

    DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

    def __init__(self, kind: str, num_params: int, device: torch.device) -> None:
        self.dtype = self.DTYPES[kind]
        self.num_params = num_params
        self.residual = torch.zeros(num_params, device=device)

    def __call__(self, message: torch.Tensor) -> torch.Tensor:
        n = self.num_params
        grads = message[:n]
        grads.add_(self.residual)
        wire = torch.empty(n + 2 * (message.numel() - n), dtype=self.dtype, device=message.device)
        wire[:n].copy_(grads)
        wire[n:].copy_(message[n:].view(self.dtype))
        torch.sub(grads, wire[:n].float(), out=self.residual)
        return wire

    @staticmethod
    def slice(wire: torch.Tensor, num_params: int, start: int, end: int) -> torch.Tensor:
        """Values start..end of the state vector in a compressed message (a PS shard's part)."""
        def at(i: int) -> int:
            return i if i <= num_params else num_params + 2 * (i - num_params)
        return wire[at(start):at(end)]


class Trainer:
    """The training loop of one worker; `train()` returns the number of pushes."""

    def __init__(self, config: Config, model: nn.Module, loader: torch.utils.data.DataLoader,
                 sampler: data.ShardSampler, device: torch.device, client: PSClient,
                 metrics: MetricsWriter) -> None:
        self.config, self.model, self.loader, self.sampler = config, model, loader, sampler
        self.device, self.client, self.metrics = device, client, metrics
        self.flat = FlatModel(model)
        self.loss_fn = nn.CrossEntropyLoss()
        self.format = runtime.memory_format(config, device)
        # fp16 (CUDA only): the loss is scaled before backward and the gradient unscaled
        # after it; a batch whose gradient overflowed is not pushed, and the scale halves.
        # The scaler needs an optimizer to unscale through: a local one, never stepped.
        self.scaler = (torch.amp.GradScaler("cuda") if config.precision == "fp16" else None)
        self._unscaler = torch.optim.SGD(model.parameters(), lr=0.0) if self.scaler else None
        self.skipped = 0  # fp16: batches not pushed (gradient overflow)
        self.compress = (Compressor(config.compress, self.flat.num_params, device)
                         if config.compress != "none" else None)
        wire_dtype = self.compress.dtype if self.compress else torch.float32
        # RPC carries CPU tensors only: a GPU worker stages its message here
        # (two buffers, used by pushes sent in turn: with --overlap one is on the wire
        # while the next fills).
        wire_size = self.flat.size + (self.flat.num_buffers if self.compress else 0)
        self.staging = ([torch.empty(wire_size, dtype=wire_dtype, pin_memory=True) for _ in range(2)]
                        if device.type == "cuda" else None)
        self.in_flight: PendingPush | None = None  # --overlap: the push on the wire
        self.version = 0
        self.pushes = 0   # pushes answered (this process and the rank's earlier ones)
        self.sent = 0     # pushes sent by this process
        self.refused = 0  # pushes the PS refused (non-finite values)
        self._refused_in_a_row = 0
        self._mark = (time.monotonic(), 0)  # (time, samples) at the last report
        self._samples = 0

    def train(self, start: dict[str, Any]) -> int:
        """From where the rank is (`start`: the PS's answer to join) to its last epoch."""
        self.model.train()
        self.flat.adopt(start["vector"])
        self.version, self.pushes = start["version"], start["pushes"]
        for epoch in range(start["epoch"], self.config.num_epochs + 1):
            done = start["batch"] if epoch == start["epoch"] else 0  # batches already pushed
            self.sampler.set_epoch(epoch, skip=done * self.config.batch_size)
            for batch, (x, y) in enumerate(self.batches(), start=done + 1):
                loss = self.compute_gradients(x, y)
                if loss is None:  # fp16: the gradient overflowed; the scale is halved
                    continue
                reply = self.push_and_pull(epoch, batch, len(y))
                self._samples += len(y)
                if batch % self.config.log_every == 0 or batch == len(self.loader):
                    self.report(epoch, batch, loss, reply)
                if self.reached_max_steps():
                    return self.last_reply()
        return self.last_reply()

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This epoch's batches; a read that fails mid-run is one clear error."""
        return data.batches(self.loader, self.config.data_dir)

    def compute_gradients(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward (under --precision's autocast) and backward; the float32 gradient lands in
        self.flat.grads. None when fp16's gradient overflowed (nothing to push)."""
        x, y = data.to_device(x, getattr(self.loader, "dataset", None), self.device), y.to(self.device, non_blocking=True)
        if x.dim() == 4:
            x = x.contiguous(memory_format=self.format)
        self.flat.zero_grads()
        with runtime.autocast(self.config.precision, self.device):
            loss = self.loss_fn(self.model(x), y)
        if self.scaler is None:
            loss.backward()
            return loss.item()
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self._unscaler)
        overflow = sum(v.item() for v in self.scaler._found_inf_per_device(self._unscaler).values())
        self.scaler.update()
        if overflow:
            self.skipped += 1
            return None
        return loss.item()

    def push_and_pull(self, epoch: int = 1, batch: int = 0, samples: int = 0) -> ps.Reply | None:
        """Send [grads | buffers] as one tensor (and where this worker is: `batch` of
        `epoch` done); continue from the fresh state the PS answers.

        With --overlap, the reply waited for is the previous push's, and this push
        stays on the wire while the next batch runs; None on the first push.
        """
        message = self.flat.pack_message()
        if self.compress is not None:
            message = self.compress(message)
        if self.staging is not None:  # the other buffer may still be on the wire
            message = self.staging[self.sent % 2].copy_(message)
        elif self.config.overlap and message is self.flat.message:
            message = message.clone()  # the next backward writes into flat.message
        self.sent += 1
        if not self.config.overlap:
            return self._take(self.client.push(message, self.version, epoch, batch, samples))
        computed_on = self.version  # the state this gradient comes from, before the reply below
        reply = self._wait_in_flight()
        self.in_flight = self.client.push_async(message, computed_on, epoch, batch, samples)
        return reply

    def last_reply(self) -> int:
        """The end of training: take the reply still on the wire (--overlap); the pushes made."""
        self._wait_in_flight()
        return self.pushes

    def _wait_in_flight(self) -> ps.Reply | None:
        pending, self.in_flight = self.in_flight, None
        return self._take(pending.wait()) if pending is not None else None

    def _take(self, reply: ps.Reply | ps.Refusal) -> ps.Reply | None:
        """Continue from the reply's state; a refused push (non-finite) is skipped: None."""
        if isinstance(reply, ps.Refusal):
            return self._skip(reply)
        self._refused_in_a_row = 0
        self.flat.adopt(reply.vector)  # the received tensor is ours: no copy
        self.version = reply.version
        self.pushes += 1
        return reply

    def _skip(self, refusal: ps.Refusal) -> None:
        self.refused += 1
        self._refused_in_a_row += 1
        if self._refused_in_a_row >= MAX_REFUSED_IN_A_ROW:
            raise RuntimeError(f"{self._refused_in_a_row} pushes in a row were refused ({refusal.message}): "
                               "training diverged; try a lower --lr")
        if self.refused == 1:
            log.warning("%s; skipping that batch (refusals are counted in the metrics)", refusal.message)
        if self.metrics is not None:
            self.metrics.write("refused", self.pushes, refused=self.refused)
        return None

    def reached_max_steps(self) -> bool:
        sent = self.pushes + (self.in_flight is not None)
        return 0 < self.config.max_steps <= sent

    def report(self, epoch: int, batch: int, loss: float, reply: ps.Reply | None) -> None:
        now = time.monotonic()
        then, samples_then = self._mark
        rate = (self._samples - samples_then) / max(now - then, 1e-9)
        self._mark = (now, self._samples)
        progress.info("%s | Epoch: %d | Batch: %d | Loss: %.2f", self.config.name, epoch, batch, loss)
        fields = {"staleness": reply.staleness, "lead": reply.lead} if reply is not None else {}
        self.metrics.write("train", self.pushes, epoch=epoch, batch=batch, loss=round(loss, 4),
                           samples_per_s=round(rate, 1), **fields, **data.skipped(self.loader.dataset))


def run(config: Config) -> int:
    """The worker process: check input, join (or rejoin) the job, train, report, leave."""
    device = choose_device(config.device)
    runtime.tune_for(device)
    models.check(config.model)
    train = data.load(config.dataset, config.data_dir, "train", config.seed, config.image_size, config.image_cache)
    sampler = data.ShardSampler(len(train.data), config.num_trainers, config.rank - 1, config.seed)  # type: ignore[arg-type]
    loader = data.train_loader(train.data, sampler, config.batch_size, config.num_workers,
                               pin_memory=device.type == "cuda")
    log.info("%s: shard of %d samples (%s)", config.name, len(sampler), data.describe(train))
    model = models.build(config.model, train.channels, train.num_classes, config.seed).to(device)
    name, rpc_id = membership.claim_identity(config.rank, config.master_addr, config.master_port,
                                             config.rpc_timeout)
    # Under ssp and sync a push waits for the slowest worker, which may be a rank the
    # PS waits join_timeout for.
    push_wait = config.join_timeout if config.strategy in ("ssp", "sync") else 0.0
    client: PSClient | shards.ShardedClient = PSClient(
        config.rank, config.rpc_timeout, f"{config.master_addr}:{config.master_port}", name, push_wait)
    if config.shards > 1:  # join the RPC group once every PS shard is in it (app.shards)
        shards.wait_until_ready(config.master_addr, config.master_port, config.join_timeout)
        client = shards.ShardedClient(client, chained=config.staleness_lr)
        client.num_params = sum(p.numel() for p in model.parameters())
    with MetricsWriter(config.metrics_dir, config.name, "worker", config.rank) as metrics:
        started = time.monotonic()
        with rpc_session(config, rank=rpc_id, name=name):
            start = client.join()
            metrics.write("join", start["pushes"], worker=name, epoch=start["epoch"], batch=start["batch"],
                          **gpu_identity(device))
            trainer = Trainer(config, model, loader, sampler, device, client, metrics)
            pushes = trainer.train(start)
            client.finish(pushes)
            metrics.write("end", pushes, seconds=round(time.monotonic() - started, 2), refused=trainer.refused,
                          skipped=trainer.skipped, **data.skipped(train.data))
    return 0
