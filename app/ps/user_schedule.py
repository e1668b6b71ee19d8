"""`train.schedule: {name: package.module:factory, ...}`: the user's own learning-rate schedule,
a torch.optim.lr_scheduler built by `factory(optimizer, total_updates, **kwargs)` and stepped
once per update the PS applies, as a factor of the optimizer's rate (app/ps/state.py).

The scheduler runs over an optimizer of one dummy parameter whose rate starts at 1.0: its rate
is the factor, so it composes with any optimizer the PS steps (its own SGD included) and with
the warmup. It is built once the run's length is known (the first push says it); its state is
checkpointed with the PS's. Every PS shard builds and steps its own alike: a schedule is a
function of the updates applied, so they agree.
"""

from __future__ import annotations

from typing import Any

import torch

from app import plugins
from app.config import UsageError
from app.recipes import WARMUP_KEYS, Spec


class UserSchedule:
    """The factor the user's scheduler gives the rate of the next update."""

    def __init__(self, schedule: Spec) -> None:
        self.schedule = schedule
        self.where = f"--schedule {schedule['name']}"
        self.factory = plugins.resolve("schedule", schedule["name"])
        self._holder = _holder()
        self.scheduler: Any = None
        self._make(_holder(), 1)  # a factory that fails, or returns no scheduler, stops the PS as it starts

    def _make(self, holder: torch.optim.Optimizer, total: int) -> Any:
        kwargs = {k: v for k, v in self.schedule.items() if k != "name" and k not in WARMUP_KEYS}
        made = plugins.call(self.where, self.factory, holder, total, **kwargs)
        if not isinstance(made, torch.optim.lr_scheduler.LRScheduler):
            raise UsageError(
                f"{self.where}: returned a {type(made).__name__}; must return a torch.optim.lr_scheduler.LRScheduler"
            )
        return made

    def start(self, total: int, done: int, saved: dict[str, Any] | None = None) -> None:
        """Build the scheduler for a run of `total` updates, `done` of them applied already (or
        from `saved`, a checkpoint's state)."""
        self._holder = _holder()
        self.scheduler = self._make(self._holder, total)
        if saved is not None:
            self.load_state_dict(saved)
        else:
            for _ in range(done):
                self.step()

    @property
    def factor(self) -> float:
        return float(self._holder.param_groups[0]["lr"])

    def step(self) -> None:
        """One update applied."""
        if self.scheduler is not None:
            self._holder.step()  # torch warns of a scheduler stepped before its optimizer
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any] | None:
        if self.scheduler is None:
            return None
        return {"scheduler": self.scheduler.state_dict(), "factor": self.factor}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(saved["scheduler"])
        self._holder.param_groups[0]["lr"] = float(saved["factor"])


def _holder() -> torch.optim.Optimizer:
    """An optimizer of one dummy parameter at rate 1.0: what the user's scheduler sets the rate of."""
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
