"""Where a topology runs: `compose` (one host) and `swarm` (`docker stack`); each an
`adapter` (Docker and its command lines) and the `verbs` the CLI calls."""
