"""The parameter server: its state machine, RPC endpoints, members, checkpoints, shards and process."""
