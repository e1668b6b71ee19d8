"""The training app: one Parameter Server and N workers over torch.distributed.rpc.

`python -m app ps|worker|health|check [flags]`; docs/design.md holds the layout and the contracts.
"""
