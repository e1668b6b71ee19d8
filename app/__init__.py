"""The training app: one Parameter Server and N workers over the job's own transport (app/exchange/transport.py).

`python -m app ps|worker|health|check [flags]`; docs/design.md holds the layout and the contracts.
"""
