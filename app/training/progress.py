"""How far a run is, as numbers and as one line: step of total, percent, samples/s, ETA.

Pure arithmetic over numbers the caller measured: the updates applied (`done`), the updates
the run will have applied at its end (`total`, None where it cannot be known), and the pace
over a recent window (the PS's: since its previous evaluation). The ETA is what is left at
that window's update rate, so it follows a scale up or down within one window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def percent(done: int, total: Optional[int]) -> Optional[float]:
    """`done` of `total` in percent, one decimal, at most 100; None when the total is unknown."""
    if total is None or total <= 0:
        return None
    return round(min(100.0, 100.0 * done / total), 1)


def eta_seconds(done: int, total: Optional[int], updates_per_s: float) -> Optional[float]:
    """Seconds until `total` at `updates_per_s`: 0 once it is reached; None when the total is
    unknown, or no update was applied in the window (no rate to go by)."""
    if total is None:
        return None
    left = total - done
    if left <= 0:
        return 0.0
    if updates_per_s <= 0:
        return None
    return round(left / updates_per_s, 1)


def clock(seconds: float) -> str:
    """`H:MM:SS`, rounded to the second (257 -> 0:04:17; days count as hours)."""
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


@dataclass(frozen=True)
class RunProgress:
    """Where a run is: `done` updates of `total` (None: unknown), at a recent window's pace."""

    done: int
    total: Optional[int]
    updates_per_s: float
    samples_per_s: float

    @property
    def percent(self) -> Optional[float]:
        return percent(self.done, self.total)

    @property
    def eta_s(self) -> Optional[float]:
        return eta_seconds(self.done, self.total, self.updates_per_s)

    def fields(self) -> dict[str, float | int]:
        """For a metrics record: `total`, `percent` and `eta_s`, each where it is known."""
        known = {"total": self.total, "percent": self.percent, "eta_s": self.eta_s}
        return {key: value for key, value in known.items() if value is not None}

    def line(self) -> str:
        """`step 1200 of 4680 (25.6%), 812 samples/s, ETA 0:04:17`; `step 1200 (total unknown),
        812 samples/s`; `ETA unknown` when no update was applied in the window."""
        return line(self.done, self.total, self.samples_per_s, self.eta_s)


def line(done: int, total: Optional[int], samples_per_s: float, eta_s: Optional[float]) -> str:
    """The progress line of these numbers (RunProgress.line)."""
    pace = f"{samples_per_s:.0f} samples/s"
    if total is None:
        return f"step {done} (total unknown), {pace}"
    eta = "unknown" if eta_s is None else clock(eta_s)
    return f"step {done} of {total} ({percent(done, total)}%), {pace}, ETA {eta}"
