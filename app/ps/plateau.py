"""`train.schedule: plateau`: torch's ReduceLROnPlateau on the run's headline metric, stepped at
each of the main PS's evaluations, as a factor of the optimizer's rate (app/ps/state.py).

The scheduler runs over an optimizer of one dummy parameter whose rate starts at 1.0: its rate
is the factor. Its state (the best value, the evaluations since, the cooldown) is checkpointed
with the PS's, so a resumed run goes on as if it never stopped.
"""

from __future__ import annotations

from typing import Any

import torch

from app.recipes import Spec, plateau_mode


class Plateau:
    """The factor a plateau schedule gives the rate now, lowered when the headline stalls."""

    def __init__(self, schedule: Spec, metrics: str, base_lr: float) -> None:
        self._holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self._holder,
            mode="max" if plateau_mode(schedule, metrics) == "max" else "min",
            factor=float(schedule.get("factor", 0.1)),
            patience=int(schedule.get("patience", 10)),
            threshold=float(schedule.get("threshold", 1e-4)),
            threshold_mode="abs" if schedule.get("threshold_mode") == "abs" else "rel",
            cooldown=int(schedule.get("cooldown", 0)),
            min_lr=float(schedule.get("min_lr", 0.0)) / base_lr,
        )

    @property
    def factor(self) -> float:
        return float(self._holder.param_groups[0]["lr"])

    def observe(self, headline: float) -> bool:
        """One evaluation's headline; whether the factor fell."""
        before = self.factor
        self.scheduler.step(headline)
        return self.factor < before

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "factor": self.factor}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(saved["scheduler"])
        self._holder.param_groups[0]["lr"] = float(saved["factor"])
