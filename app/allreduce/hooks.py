"""The gradient compression of an allreduce job (--compress bf16|fp16): DDP communication hooks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def compress_hook(name: str, backend: str) -> Any:
    """DDP's fp16_compress_hook / bf16_compress_hook (registered with state None). torch's
    bf16 hook refuses anything but NCCL, though Gloo reduces bfloat16: on Gloo, the same
    hook written out (`bf16_gloo_hook`)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if name == "fp16":
        return default_hooks.fp16_compress_hook
    return default_hooks.bf16_compress_hook if backend == "nccl" else bf16_gloo_hook


def bf16_gloo_hook(process_group, bucket):
    """What bf16_compress_hook does: the bucket cast to bfloat16, divided by the world size,
    allreduced, cast back into the bucket. (No annotations: register_comm_hook compares them
    with the real classes, and this module's are strings.)"""
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None, "DDP calls its hooks in a joined process group"
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut):
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)
