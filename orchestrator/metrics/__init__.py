"""A run's JSON-lines metrics read back: `records` (the one reader), `run_metrics`
(a run and its figures), `report` (plots), `compare` (the strategies side by side)."""
