"""What the PS counts of the pushes it takes, for its `eval` and `end` records: pushes applied,
the samples behind them, their staleness (sum, max, histogram), the non-finite pushes refused
per rank, and the pushes answered before their new state was written whole (streamed).

Plain counters: app.ps.server and the strategy's policy change them under the server's lock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PushCounts:
    applied: int = 0  # pushes applied by this process (the version may start from a checkpoint)
    samples: int = 0  # training samples behind the updates applied by this process
    staleness_sum: int = 0
    staleness_max: int = 0
    staleness_hist: Counter[int] = field(default_factory=Counter)
    refused: Counter[int] = field(default_factory=Counter)  # rank -> non-finite pushes refused
    streamed: int = 0  # pushes answered with the first partition of their new state written (app.ps.state)

    def count(self, staleness: int) -> None:
        """One push applied, `staleness` updates late."""
        self.applied += 1
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_hist[staleness] += 1

    def refuse(self, rank: int) -> bool:
        """One push of rank's refused (NaN or inf); True when it is rank's first."""
        self.refused[rank] += 1
        return self.refused[rank] == 1

    def fields(self, pushes: dict[int, int]) -> dict[str, Any]:
        """The `end` record's fields: `pushes` per rank, the staleness, the refusals."""
        mean = self.staleness_sum / self.applied if self.applied else 0.0
        return {
            "pushes": {f"worker{r}": n for r, n in sorted(pushes.items())},
            "staleness_mean": round(mean, 3),
            "staleness_max": self.staleness_max,
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
            "refused": {f"worker{r}": n for r, n in sorted(self.refused.items())},
            "streamed": self.streamed,
        }
