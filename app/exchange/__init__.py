"""The exchange between a worker and its PS: what crosses, the RPC calls both sides name, and
the same-host shared memory."""
