"""A parameter server sharded across K processes (`--shards K`): no process carries every byte.

The state vector [params | float buffers] (app.training.flat) is cut into K contiguous,
balanced slices (`bounds`). SGD with momentum is elementwise, so each shard
applies to its slice exactly the update one PS would; buffers slice the same
way. Every shard runs the same `ParameterServer` (`part=bounds[i]`) and
strategy, and sees every worker's push of its slice.

- Shard 0 is the main PS (`ps`, at master_addr): it starts the RPC group, holds
  the store, admits and pings workers, evaluates and writes final.pt
  (app.ps.sharding.shardset). It waits for the K-1 other shards before it admits a
  worker (`ShardSet.join` answers `wait`; workers wait for READY_KEY in the
  store before they even join the RPC group, so they learn every shard's
  name), answers a join with the
  shards' names and bounds, forwards worker drops to them, gathers their
  slices to evaluate and for final.pt, and tells them when training ended.
- Shard I>0 (`python -m app ps --shard I`, app.ps.sharding.shard_process) claims `ps<I>`
  (`ps<I>_r2`, ... after a restart) through the store, joins the group (it
  stays on the store's member list, so every later joiner learns it),
  registers with the main PS, serves its slice, checkpoints it under
  `<checkpoint_dir>/shard<I>/`, exits 0 when told training ended and 1 when
  it loses the main PS.
- Checkpoints are driven by the main PS: before it writes its own at version
  V, every other shard writes its slice labelled V (`rpc_checkpoint`); if one
  cannot, the main PS writes none. The main PS's newest checkpoint therefore
  has a partner labelled V in every shard's directory, and a (re)starting
  shard asks the main PS which V it resumed from (`rpc_resumed`) and restores
  its checkpoint labelled V (`checkpoint_labelled`), never a newer one of its
  own. A shard restarted while the main PS runs on restores the main PS's
  last checkpoint label too: its slice is then older than the others' until
  training moves on (the price of not stopping the whole job).
- What is identical to one PS: every shard applies the same SGD elementwise,
  so the assembled vector equals one PS's bit for bit whenever every shard
  applied the same pushes in the same order: always for sync (a round's
  gradients are averaged in rank order), and for async/ssp when pushes do not
  overlap in time. RPC does not order overlapping pushes across shards, so
  then slices may apply them in different orders (with momentum, different
  bits). A push's staleness is the main PS's, for every slice: with
  --staleness_lr a worker sends the other slices once the main PS answered,
  with its staleness (`ShardedRoute.chained`); the reply's staleness and lead
  are the main PS's.
- A worker (app.worker.channels.PSChannel) joins every shard, and its route
  (app.worker.sharded.ShardedRoute, over a route per shard) pushes each its slice
  (a contiguous copy of its own) in parallel and assembles the replies with one copy.
"""

from __future__ import annotations


def bounds(size: int, k: int) -> list[tuple[int, int]]:
    """K contiguous slices of range(size), lengths differing by at most one."""
    if k < 1:
        raise ValueError(f"{k} shards: must be at least 1")
    step, extra = divmod(size, k)
    out, start = [], 0
    for i in range(k):
        end = start + step + (i < extra)
        out.append((start, end))
        start = end
    return out


class MainPSLost(RuntimeError):
    """A shard lost the main PS (it died, or did not answer within rpc_timeout)."""
