"""The topology: its typed model (`model`), the services it has (`services`), and the
values the orchestrator and the app agree on (`contract`). Nothing here reads a file
but the topology itself, or talks to an engine."""
