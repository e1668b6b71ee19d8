"""The training app: one Parameter Server and N workers over PyTorch RPC (app/exchange/transport.py).

`python -m app ps|worker|health|check [flags]`; docs/design.md holds the layout and the contracts.
"""
