"""A PS split across K processes (`ps.shards`): `slices` (how the state vector is cut),
`shardset` (the main PS's side: registration, readiness, gather, checkpoints, the end),
`shard_process` (a shard's own process). The worker's side is app/worker/sharded.py (its
route, joined through app/worker/channels.py)."""
