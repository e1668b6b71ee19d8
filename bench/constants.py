"""`python -m bench constants [--model M] [--json FILE]`: the constants of the step model
in docs/performance.md, each measured on its own, one thread per process.

In one process: the compute step (forward + backward), a memcpy of the state, the PS's
SGD step and a sync round's average of two pushes over the state, the bf16 packing of
a push (the worker's Compressor) and its widening back on the PS, torch RPC's serialisation
of the reference PS's messages (a list of gradients, the module) and, where torch sees
a GPU, the state's copies host -> device and back from pageable and from pinned memory.
Between processes (bench.procs): a Gloo send + recv of the state's bytes, and a round trip
of the state (bench.roundtrip) over the job's own transport, on a UNIX socket (PLAIN: local
processes) and over TCP with CURVE (between hosts), beside torch RPC's TensorPipe `uv` as
the reference, in CPU of both sides and in wall time. The app's push + pull is the app
itself, whatever its exchange is: `python -m app` as processes (bench/launch.py), one
worker, async, on ResNet-18's state with no compute (the GPU regime's model at C = 0 ms,
bench/sleep_model), its step less the same worker step with no PS (bench/gpu.py's compute
alone). Beside it, the floor of an exchange
measured in the same run: one memcpy plus one SGD step of the state.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench import harness
from bench.models import SPECS, state_floats

MEASURES = {  # figure -> what it is; the order of the printed list
    "state_mb": "state vector: parameters + float buffers, MB (float32)",
    "compute_s": "compute step: forward + backward, one worker alone, s",
    "memcpy_s": "one memcpy of the state, s",
    "memcpy_gb_s": "memcpy bandwidth, GB/s",
    "sgd_s": "PS: one SGD step over the parameters (p -= lr * g), s",
    "ps_sgd_momentum_s": "PS: its SGD with momentum 0.9 and weight decay on the model's vector (app.ps.state), s",
    "ps_adamw_s": "PS: its AdamW on the model's vector (torch.optim's fused kernel, groups: app.ps.optim), s",
    "adamw_foreach_s": "torch.optim.AdamW foreach=True on the same parameters (not fused), s",
    "adamw_vs_memcpy": "the PS's AdamW step / one memcpy of the state",
    "sync_mean_s": "PS, sync: average of two pushes by stack + mean (how the PS once did it), s",
    "sync_inplace_s": "PS, sync: the same summed in place into one buffer (how the PS does it), s",
    "bf16_pack_s": "worker, --compress bf16: Compressor (cast + error feedback), s",
    "bf16_widen_s": "PS, --compress bf16: widening the push back to float32, s",
    "pickle_grads_s": "reference: torch RPC's serialisation of the list of gradients, s",
    "pickle_module_s": "reference: torch RPC's serialisation of the module, s",
    "gloo_s": "Gloo send + recv of the state's bytes each way, two processes, s",
    "gloo_gb_s": "Gloo: bytes both ways / send + recv time, GB/s",
    "app_pushpull_s": "app: push + pull of ResNet-18's state, `python -m app`, one worker (step less compute), s",
    "floor_s": "the floor of an exchange: one memcpy + one SGD step of the state (the two above), s",
    "pushpull_vs_floor": "app push + pull / the floor",
    "transport_unix_cpu_s": "the job's transport: a round trip of the state, UNIX socket (PLAIN): CPU of both sides, s",
    "transport_unix_wall_s": "the same: wall time of a round trip, s",
    "transport_tcp_curve_cpu_s": "the same over TCP on 127.0.0.1, encrypted (CURVE): CPU of both sides, s",
    "transport_tcp_curve_wall_s": "the same: wall time of a round trip, s",
    "tensorpipe_uv_cpu_s": "reference: torch RPC's round trip of the state, TensorPipe uv (TCP): CPU of both sides, s",
    "tensorpipe_uv_wall_s": "the same: wall time of a round trip, s",
    "transport_unix_control_wall_s": "the control round trip (8 numbers), the job's transport, UNIX socket: wall, s",
    "transport_unix_control_cpu_s": "the same: CPU of both sides, s",
    "transport_tcp_curve_control_wall_s": "the control round trip over TCP on 127.0.0.1, CURVE: wall, s",
    "transport_tcp_curve_control_cpu_s": "the same: CPU of both sides, s",
    "tensorpipe_uv_control_wall_s": "reference: the control round trip, torch RPC over TensorPipe uv: wall, s",
    "tensorpipe_uv_control_cpu_s": "the same: CPU of both sides, s",
    "h2d_pageable_s": "GPU: the state host -> device from pageable memory, s",
    "d2h_pageable_s": "GPU: the state device -> host into pageable memory, s",
    "h2d_pinned_s": "GPU: the state host -> device from pinned memory, s",
    "d2h_pinned_s": "GPU: the state device -> host into pinned memory, s",
}
PUSHPULL_MODEL = "resnet18-10"  # the state of the GPU regime's model, which the app's push + pull runs
PUSHPULL_BATCHES = (5, 60)  # warm-up and timed steps of the app's push + pull


def timed(fn: Callable[[], Any], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of `fn` over `repeats` calls, after one untimed call; `clock`
    is wall time by default, `time.process_time` for this process's CPU time."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def in_process(model_name: str, repeats: int) -> dict[str, float]:
    """The figures measured in this process (see MEASURES)."""
    from app.runtime import machine

    machine.keep_freed_memory()  # as the app's processes do: no fresh mmap per 45 MB buffer
    torch.set_num_threads(1)
    spec = SPECS[model_name]
    model, loss_fn = spec.model(), nn.CrossEntropyLoss()
    x, y = spec.batch()
    params, buffers = state_floats(model)
    floats = params + buffers
    state, other = torch.randn(floats), torch.randn(floats)
    copy_into = torch.empty(floats)
    out: dict[str, float] = {"state_mb": 4 * floats / 1e6}

    def compute() -> None:
        model.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()

    out["compute_s"] = timed(compute, max(3, repeats // 4))
    out["memcpy_s"] = timed(lambda: ctypes.memmove(copy_into.data_ptr(), state.data_ptr(), 4 * floats), repeats)
    out["memcpy_gb_s"] = 4 * floats / out["memcpy_s"] / 1e9
    p, g = state[:params], other[:params]
    out["sgd_s"] = timed(lambda: p.add_(g, alpha=-1e-6), repeats)
    out["sync_mean_s"] = timed(lambda: torch.stack([state, other]).mean(0), repeats)
    out["sync_inplace_s"] = timed(lambda: copy_into.copy_(state).add_(other).mul_(0.5), repeats)
    out.update(_ps_steps(model, repeats))
    out["adamw_vs_memcpy"] = out["ps_adamw_s"] / out["memcpy_s"]
    out.update(_bf16(params, floats, other, repeats))
    out.update(_pickling(model, repeats))
    return out


def _ps_steps(model: nn.Module, repeats: int) -> dict[str, float]:
    """The PS's own step (app.ps.state.State.step: the recipe's optimizer on the model's vector,
    stepped in place) with SGD + momentum and with AdamW, and torch's AdamW with foreach."""
    from app.ps.state import State, StateConfig

    out: dict[str, float] = {}
    for figure, config in (
        ("ps_sgd_momentum_s", StateConfig(0.01, momentum=0.9, weight_decay=1e-4)),
        ("ps_adamw_s", StateConfig(0.01, optimizer={"name": "adamw", "weight_decay": 0.1})),
    ):
        state = State(model, config)
        message = torch.randn(state.size) * 1e-3
        out[figure] = timed(lambda s=state, m=message: s.step(m), repeats)
    params = [p.detach().clone() for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    foreach = torch.optim.AdamW(params, lr=0.01, foreach=True)
    out["adamw_foreach_s"] = timed(foreach.step, repeats)
    return out


def _bf16(params: int, floats: int, message: torch.Tensor, repeats: int) -> dict[str, float]:
    from app.exchange.wire import to_float32
    from app.worker.compress import Compressor

    pack = Compressor("bf16", params, torch.device("cpu"))
    wire = pack(message.clone())
    return {
        "bf16_pack_s": timed(lambda: pack(message), repeats),
        "bf16_widen_s": timed(lambda: to_float32(wire, params), repeats),
    }


def _pickling(model: nn.Module, repeats: int) -> dict[str, float]:
    """torch RPC's own pickler, as the reference PS's messages go: tensors go to a side table (sent
    as they are), the rest is pickled."""
    from torch.distributed.rpc.internal import _internal_rpc_pickler

    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    grads = [q.grad for q in model.parameters()]
    return {
        "pickle_grads_s": timed(lambda: _internal_rpc_pickler.serialize(grads), repeats),
        "pickle_module_s": timed(lambda: _internal_rpc_pickler.serialize(model), repeats),
    }


def gloo_send_recv(model_name: str, seconds: float) -> dict[str, float]:
    """A Gloo send + recv of the state's bytes each way between two processes."""
    from bench.procs import Case, run_case

    params, buffers = state_floats(SPECS[model_name].model())
    p = dict(
        warmup=3,
        seconds=seconds,
        tail=0.0,
        threads=1,
        compute=False,
        compute_seconds=None,
        floats=params + buffers,
        shards=1,
        compress="none",
        overlap=False,
        strategy="async",
    )
    gloo = run_case(Case("gloo", model_name, 1), p, timeout=120 + 4 * seconds)["workers"][0]
    both_ways = 2 * 4 * (params + buffers)
    return {"gloo_s": gloo["comm_s"], "gloo_gb_s": both_ways / gloo["comm_s"] / 1e9}


def app_pushpull(timeout: float) -> dict[str, float]:
    """The app's push + pull of ResNet-18's state: `python -m app` as processes, one worker,
    async, the GPU regime's model at C = 0 ms; the steady step of that run less the steady
    step of the same worker step (`Trainer.compute_gradients`) with no PS."""
    from bench import gpu
    from bench.gpu_report import steady_step
    from bench.launch import metrics

    warmup, steps = PUSHPULL_BATCHES
    topology = gpu.topology("async", 0, 1, 1, warmup + steps)
    times, numbers = gpu.batch_times(metrics("local", topology, timeout), 1)
    app = steady_step(times, warmup, numbers)["step_s"]
    alone = steady_step(gpu.run_compute_alone(0, warmup + steps), warmup)["step_s"]
    return {"app_pushpull_s": app - alone}


def floor(figures: dict[str, float]) -> dict[str, float]:
    """The floor of an exchange (a memcpy and an SGD step of the state) and the app's push +
    pull against it, from figures of the same run; {} without them."""
    if not {"memcpy_s", "sgd_s"} <= set(figures):
        return {}
    out = {"floor_s": figures["memcpy_s"] + figures["sgd_s"]}
    if "app_pushpull_s" in figures:
        out["pushpull_vs_floor"] = figures["app_pushpull_s"] / out["floor_s"]
    return out


def copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int, sync: Callable[[], None]) -> float:
    """Median seconds of `dst.copy_(src)` (non-blocking from or into pinned memory), `sync()`
    waiting for it to land."""

    def copy() -> None:
        dst.copy_(src, non_blocking=src.is_pinned() or dst.is_pinned())
        sync()

    return timed(copy, repeats)


def device_copies(floats: int, repeats: int) -> dict[str, float]:
    """The state's copies host -> device and back, from and into pageable and pinned host
    memory, where torch sees a GPU; {} elsewhere."""
    if not torch.cuda.is_available():
        return {}
    on_device = torch.empty(floats, device="cuda")
    out = {}
    for kind, pinned in (("pageable", False), ("pinned", True)):
        host = torch.empty(floats, pin_memory=pinned)
        out[f"h2d_{kind}_s"] = copy_seconds(on_device, host, repeats, torch.cuda.synchronize)
        out[f"d2h_{kind}_s"] = copy_seconds(host, on_device, repeats, torch.cuda.synchronize)
    return out


def lines(figures: dict[str, float]) -> str:
    """One line per figure measured, in MEASURES order."""
    return "\n".join(f"{name:<26} {figures[name]:>10.4g}  {what}" for name, what in MEASURES.items() if name in figures)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("constants", help="the step model's constants (docs/performance.md)")
    p.add_argument("--model", default="resnet18-10", choices=sorted(SPECS))
    p.add_argument("--repeats", type=int, default=20, help="timed calls per in-process figure")
    p.add_argument("--seconds", type=float, default=3.0, help="window of the Gloo figure")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the app's run (its push + pull)")
    p.add_argument("--json", metavar="FILE")


def main(args: argparse.Namespace) -> int:
    from bench import roundtrip

    started, failures = time.monotonic(), []
    figures = in_process(args.model, args.repeats)
    figures.update(gloo_send_recv(args.model, args.seconds))
    if args.model == PUSHPULL_MODEL:
        pushpull = functools.partial(app_pushpull, timeout=args.timeout)
        figures.update(harness.attempt("bench constants", "the app's push + pull", pushpull, failures) or {})
    figures.update(floor(figures))
    params, buffers = state_floats(SPECS[args.model].model())
    figures.update(roundtrip.round_trips(params + buffers, args.repeats))
    figures.update(device_copies(params + buffers, args.repeats))
    print(f"{args.model}, one thread per process:")
    print(lines(figures))
    if args.model != PUSHPULL_MODEL:
        print(f"(the app's push + pull runs on {PUSHPULL_MODEL}'s state only: --model {PUSHPULL_MODEL})")
    if "h2d_pinned_s" not in figures:
        print("(no GPU: the host <-> device copies are measured where torch.cuda.is_available())")
    print(f"{time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.1f}")
    if args.json:
        doc = {"kind": "constants", "model": args.model, "figures": figures, "loadavg": os.getloadavg()}
        harness.write_json(args.json, doc)
    if failures:
        print("failed:\n  " + "\n  ".join(failures))
    return 1 if failures else 0
