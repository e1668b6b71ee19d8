"""The state vector cut into partitions: the pieces a GPU worker copies its gradient out in as
its backward finishes each one (app.exchange.backward_copies), and the state back in as its
forward needs each one (app.exchange.ordered_pull); the pieces a PS writes a streamed reply in
(app.ps.state), which a CPU worker's forward waits for (app.exchange.streamed_pull).

Partitions are contiguous ranges of the flat state [params | float buffers] (app.training.flat),
cut at parameter boundaries, each at least `target` values (a parameter larger than that is a
partition of its own); the last one runs to the end of the vector, so it also holds the
buffers. The backward produces the gradients of the last layers first, so the last partitions
are copied out first.
"""

from __future__ import annotations

from collections.abc import Sequence

TARGET_VALUES = 1 << 20  # 4 MiB of float32: BytePS's partition size
# A streamed reply's partitions (app.ps.state, app.exchange.streamed_pull): smaller, so the
# first, which the PS writes before it answers, is short, and a forward waits for little at a time.
STREAMED_VALUES = 1 << 18


def cut(sizes: Sequence[int], total: int, target: int = TARGET_VALUES) -> list[tuple[int, int]]:
    """[start, end) of each partition of a state of `total` values whose parameters have
    `sizes` values each, in order (their sum is at most `total`: the rest is buffers)."""
    if target < 1:
        raise ValueError(f"a partition of {target} values: must be at least 1")
    if sum(sizes) > total:
        raise ValueError(f"parameters of {sum(sizes)} values do not fit a state of {total}")
    parts, start, end = [], 0, 0
    for size in sizes:
        end += size
        if end - start >= target:
            parts.append((start, end))
            start = end
    if start < total or not parts:
        parts.append((start, total))
    else:  # the buffers (none here) go with the last partition
        parts[-1] = (parts[-1][0], total)
    return parts


def owners(sizes: Sequence[int], parts: Sequence[tuple[int, int]]) -> list[int]:
    """The partition each parameter is in, in order."""
    out, offset, j = [], 0, 0
    for size in sizes:
        while offset >= parts[j][1]:
            j += 1
        out.append(j)
        offset += size
    return out
