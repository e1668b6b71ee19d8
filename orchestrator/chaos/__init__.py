"""Faults injected into a CPU run: `common` (the kit), `processes`, `checkpoints`,
`containers` (the scenarios) and `registry` (names them, runs them, prints the table)."""
