"""Docker Compose: `adapter` (the compose command line and the SDK reads), `status`
(pure parsing of containers and metrics), `verbs` (build, up, down, logs, status, smoke)."""
