"""Docker Swarm: `adapter` (`docker stack` and the SDK reads), `verbs` (stack-up, ...)."""
