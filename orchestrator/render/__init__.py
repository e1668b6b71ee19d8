"""Topology -> document, pure: `compose` (a compose file), `swarm` (a stack file),
`yamlio` (the YAML text of a document, and the one atomic write)."""
