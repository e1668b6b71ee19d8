"""ps-compose orchestrator: a typed YAML topology, rendered to a compose file.

`python -m orchestrator render|local ...` (see `orchestrator.cli`). The layout:
`topology/` (the typed model, its services, the values shared with the app), `render/` (pure: topology -> document),
`backends/` (compose and swarm: Docker calls and their verbs), `chaos/`,
`metrics/`; `errors.py` holds every error the CLI turns into an exit status.
"""
