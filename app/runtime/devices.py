"""The training device: its choice, its tuning, autocast and memory format, a GPU's identity."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from app.config import Config, UsageError


def autocast(precision: str, device: torch.device, cache: bool = True) -> Any:
    """The forward's autocast context for --precision (none for fp32); bf16 runs on CPU too.
    `cache` False: no cache of the cast weights (a CUDA graph's capture needs none)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


def tune_for(device: torch.device) -> None:
    """CUDA: let cuDNN pick the fastest kernels for the (fixed) input shapes."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def memory_format(config: Config, device: torch.device) -> torch.memory_format:
    """--channels_last on CUDA; the default (contiguous) elsewhere."""
    return torch.channels_last if config.channels_last and device.type == "cuda" else torch.contiguous_format


def choose_device(name: str) -> torch.device:
    """`cpu`, or `cuda:0` (the one GPU a container sees); UsageError when there is none."""
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                "--device cuda: no CUDA GPU is visible to this process "
                "(torch.cuda.is_available() is False); use --device cpu"
            )
        return torch.device("cuda:0")
    return torch.device("cpu")


def gpu_identity(device: torch.device) -> dict[str, str]:
    """The GPU a process trains on, for its metrics' `join` record: {gpu: name, gpu_uuid:
    GPU-<uuid> as nvidia-smi -L prints it}; empty on CPU."""
    if device.type != "cuda":
        return {}
    p = torch.cuda.get_device_properties(device)
    return {"gpu": p.name, "gpu_uuid": f"GPU-{p.uuid}"}
