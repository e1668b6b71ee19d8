"""The held-out evaluation (train.metrics): a dict of metrics of a model (or a state vector) on
the test split, its first one the run's headline.

- `accuracy` (the default): the share of predictions (the outputs' argmax over their last
  dimension: a class, or a class at each position of a sequence) equal to the targets, and the
  mean loss;
- `perplexity`: exp of the mean loss per target (a language model's cross-entropy per token),
  and the mean loss;
- `loss`: the mean loss alone (a regression);
- the user's `package.module:function`: `function(model, batches, loss) -> {name: value, ...}`,
  `batches` the held-out (inputs, targets) on the evaluation's device, `loss` the run's loss;
  the model is in eval mode and gradients are off.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from app import plugins
from app.config import UsageError
from app.data import datasets
from app.training.flat import FlatModel

Batches = Iterable[tuple[Any, torch.Tensor]]
Loss = Callable[[Any, Any], torch.Tensor]


def _mean_loss(model: nn.Module, batches: Batches, loss: Loss, correct: list[int] | None = None) -> tuple[float, int]:
    """The mean loss per target value over the batches, and the count of targets (and, into
    `correct`, the predictions equal to their target)."""
    total, count = 0.0, 0
    for x, y in batches:
        outputs = model(x)
        total += float(loss(outputs, y)) * y.numel()
        count += y.numel()
        if correct is not None:
            correct[0] += int((outputs.argmax(-1) == y).sum())
    return total / max(1, count), count


def accuracy(model: nn.Module, batches: Batches, loss: Loss) -> dict[str, float]:
    correct = [0]
    mean, count = _mean_loss(model, batches, loss, correct)
    return {"accuracy": correct[0] / max(1, count), "loss": mean}


def perplexity(model: nn.Module, batches: Batches, loss: Loss) -> dict[str, float]:
    mean, _ = _mean_loss(model, batches, loss)
    return {"perplexity": math.exp(min(mean, 700.0)), "loss": mean}


def mean_loss(model: nn.Module, batches: Batches, loss: Loss) -> dict[str, float]:
    return {"loss": _mean_loss(model, batches, loss)[0]}


BUILT_IN = {"accuracy": accuracy, "perplexity": perplexity, "loss": mean_loss}


class MetricFailed(UsageError):
    """The evaluation raised, or returned what is not a dict of numbers: one line naming --metrics.
    Before training (`Evaluator.preflight`) the PS stops on it; during a run it logs it once and
    trains on (app.ps.process)."""


def metrics_function(name: str) -> Callable[..., Any]:
    """The evaluation `name` names (train.metrics); UsageError when the user's cannot be had."""
    return BUILT_IN[name] if name in BUILT_IN else plugins.resolve("metrics", name)


def _on_device(loader: torch.utils.data.DataLoader, device: torch.device) -> Iterator[tuple[Any, torch.Tensor]]:
    for x, y in loader:
        yield datasets.to_device(x, loader.dataset, device), y.to(device, non_blocking=True)


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: torch.utils.data.DataLoader, device: torch.device, metrics: str, loss: Loss
) -> dict[str, float]:
    """The metrics of `model` on the held-out split (in eval mode; its mode is restored), as
    train.metrics names them: a dict of numbers, its first the headline."""
    return _scored(model, _on_device(loader, device), metrics, loss)


def _scored(model: nn.Module, batches: Batches, metrics: str, loss: Loss) -> dict[str, float]:
    function = metrics_function(metrics)
    was_training = model.training
    model.eval()
    try:
        got = function(model, batches, loss)
    except Exception as error:  # noqa: BLE001 - the user's metric, or a model and loss it cannot score
        raise MetricFailed(f"--metrics {metrics}: {plugins.one_line(error)}") from None
    finally:
        model.train(was_training)
    return checked(metrics, got)


def checked(metrics: str, got: Any) -> dict[str, float]:
    """An evaluation's result as a dict of floats; UsageError naming what the user's returned."""
    where = f"--metrics {metrics}"
    if not isinstance(got, Mapping) or not got:
        raise MetricFailed(f"{where}: returned {type(got).__name__}; must return a non-empty dict of name -> number")
    out = {}
    for name, value in got.items():
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError):
            raise MetricFailed(f"{where}: returned {name!r}: {value!r}; every value must be a number") from None
    return out


def headline(scores: Mapping[str, float]) -> tuple[str, float]:
    """The run's headline metric: the evaluation's first."""
    name = next(iter(scores))
    return name, scores[name]


def line(scores: Mapping[str, float]) -> str:
    """`Accuracy: 0.9805`: the headline as the logs print it."""
    name, value = headline(scores)
    return f"{name[:1].upper()}{name[1:]}: {value:.4f}"


def fields(scores: Mapping[str, float]) -> dict[str, Any]:
    """The metrics as a record's fields (rounded to 4 digits), and `metrics`: their names, the
    headline first."""
    return {**{name: round(value, 4) for name, value in scores.items()}, "metrics": list(scores)}


class Evaluator:
    """The metrics of a state vector on the held-out split, on its own model copy."""

    def __init__(
        self,
        build: Callable[[], nn.Module],
        loader: torch.utils.data.DataLoader,
        device: torch.device,
        metrics: str = "accuracy",
        loss: Loss | None = None,
        test: torch.utils.data.DataLoader | None = None,
    ) -> None:
        self.test = test  # the dataset's test split, scored once at the end (None: it has none)
        self.model = build().to(device).eval()
        self.flat = FlatModel(self.model, with_grads=False)
        self.loader, self.device, self.metrics = loader, device, metrics
        self.loss = loss if loss is not None else nn.CrossEntropyLoss()
        metrics_function(metrics)  # an entry point that cannot be had fails now, before any RPC

    def __call__(self, vector: torch.Tensor) -> dict[str, float]:
        self.flat.load(vector)
        return evaluate(self.model, self.loader, self.device, self.metrics, self.loss)

    def tested(self, vector: torch.Tensor) -> dict[str, float] | None:
        """The metrics of `vector` on the test split; None without one."""
        if self.test is None:
            return None
        self.flat.load(vector)
        return evaluate(self.model, self.test, self.device, self.metrics, self.loss)

    @torch.no_grad()
    def preflight(self, model_name: str, loss_name: str) -> None:
        """The plug-ins tried on one held-out batch before any worker trains: the model's forward,
        the loss on its outputs, the metrics on that batch. UsageError naming the one that failed
        (a TypeError, shapes that disagree), so a mistake stops the run once, at its start."""
        x, y = next(_on_device(self.loader, self.device))
        try:
            outputs = self.model(x)
        except Exception as error:  # noqa: BLE001 - the user's model
            raise UsageError(
                f"--model {model_name}: its forward on a held-out batch failed: {plugins.one_line(error)}"
            ) from None
        with warnings.catch_warnings(record=True) as said:  # torch's warning of the broadcast that then fails
            warnings.simplefilter("always")
            try:
                self.loss(outputs, y)
            except Exception as error:  # noqa: BLE001 - the loss of these outputs and targets
                shapes = f"outputs {_shape(outputs)}, targets {_shape(y)}"
                why = plugins.one_line(error)
                raise UsageError(f"--loss {loss_name}: on a held-out batch ({shapes}): {why}") from None
        for warning in said:  # the loss works: what it warned of stands
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        _scored(self.model, [(x, y)], self.metrics, self.loss)

    def state_dict(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's state dict (on CPU) holding `vector`."""
        self.flat.load(vector)
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}


def _shape(value: Any) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__
