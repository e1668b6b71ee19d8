"""The training app: one Parameter Server and N workers over torch.distributed.rpc.

`python -m app ps|worker|health [flags]`; docs/design.md holds the contracts.
"""
