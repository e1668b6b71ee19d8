"""The values the orchestrator and the app must agree on, in one torch-free module.

The app keeps its own copies (its flag choices); tests/orchestrator/test_contract.py
holds the two equal. The topology's `Literal` fields are built from these tuples,
so a value added here is accepted by the topology and the render at once.
"""

from __future__ import annotations

STRATEGIES = ("async", "sync", "ssp", "allreduce")
COMPRESSIONS = ("none", "bf16", "fp16")
PRECISIONS = ("fp32", "bf16", "fp16")
DATASETS = ("imagefolder", "mnist", "cifar10", "digits", "synthetic")
IMAGE_CACHES = ("auto", "off", "memory", "file")  # train.image_cache (the app's --image_cache)
# Datasets the app reads from files under data_dir (the others ship in a
# package or are generated, and need no mount).
FILE_DATASETS = frozenset({"imagefolder", "mnist", "cifar10"})
CHECK_RECORD = "psc-check-record "  # the connectivity check's result line (app/contract.py CHECK_RECORD)
TRAINING_ROLES = ("ps", "worker")  # the roles that train (app/contract.py TRAINING_ROLES)
NO_PS_STRATEGY = "allreduce"  # DDP: no parameter server, worker1 is rank 0


def rpc_name(role: str, rank: int, shard: int) -> str:
    """The name a process registers under, and its metrics file's stem: ps, ps<shard>, worker<rank>."""
    if role == "ps":
        return f"ps{shard or ''}"
    return f"worker{rank}"
