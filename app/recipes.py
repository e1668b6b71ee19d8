"""A run's recipe as data: the optimizer, the learning-rate schedule, the loss and the metrics,
each a name (or the user's `package.module:factory`) with its keyword arguments.

Standard library only: the topology checks a recipe on a host without torch, naming the key at
fault and what is allowed, and the app checks it the same way before it builds anything
(app/ps/optim.py, app/training/losses.py, app/training/evaluate.py build them). The tables of
torch's optimizers and losses and their keyword arguments are torch 2.14.1's;
tests/app/training/test_recipes.py holds them to the installed torch's signatures.

A spec is a mapping `{"name": NAME, **kwargs}`; a bare name is `{"name": NAME}`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

from app.contract import ENTRY_POINT, strategy_of

Spec = dict[str, Any]

# torch.optim's optimizers by the name a recipe gives (the class name in lower case), with the
# keyword arguments each takes. Left out: LBFGS (its step needs a closure), SparseAdam (sparse
# gradients), Muon (2-D parameters only).
OPTIMIZERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sgd": ("SGD", ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "fused")),
    "adam": (
        "Adam",
        ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "fused", "decoupled_weight_decay"),
    ),
    "adamw": ("AdamW", ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused")),
    "adamax": ("Adamax", ("lr", "betas", "eps", "weight_decay", "foreach", "maximize")),
    "adagrad": (
        "Adagrad",
        ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "foreach", "maximize", "fused"),
    ),
    "adadelta": ("Adadelta", ("lr", "rho", "eps", "weight_decay", "foreach", "maximize")),
    "adafactor": ("Adafactor", ("lr", "beta2_decay", "eps", "d", "weight_decay", "foreach", "maximize")),
    "asgd": ("ASGD", ("lr", "lambd", "alpha", "t0", "weight_decay", "foreach", "maximize")),
    "nadam": (
        "NAdam",
        ("lr", "betas", "eps", "weight_decay", "momentum_decay", "decoupled_weight_decay", "foreach", "maximize"),
    ),
    "radam": ("RAdam", ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "foreach", "maximize")),
    "rmsprop": ("RMSprop", ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "foreach", "maximize")),
    "rprop": ("Rprop", ("lr", "etas", "step_sizes", "foreach", "maximize")),
}
# diloco_async's outer optimizer by default (`outer_optimizer`): not one a recipe names.
DELAYED_NESTEROV = "delayed_nesterov"
# The values torch's optimizers take for their keys (checked before anything is built, so a bad
# one is named at the render, not as the PS's IndexError): what each must be, and the test.
_NUMBER = (int, float)


def _real(v: Any) -> bool:
    return isinstance(v, _NUMBER) and not isinstance(v, bool) and math.isfinite(v)


def _pair(test: Any) -> Any:
    return lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(test(x) for x in v)


_AT_LEAST_0 = ("a number >= 0", lambda v: _real(v) and v >= 0)
VALUES: dict[str, tuple[str, Any]] = {
    **{k: ("true or false", lambda v: isinstance(v, bool)) for k in ("nesterov", "amsgrad", "maximize", "centered")},
    **{k: ("true or false", lambda v: isinstance(v, bool)) for k in ("decoupled_weight_decay", "foreach", "fused")},
    **{k: _AT_LEAST_0 for k in ("eps", "weight_decay", "momentum", "dampening", "lr_decay", "lambd", "t0")},
    **{k: _AT_LEAST_0 for k in ("initial_accumulator_value", "momentum_decay", "alpha", "d")},
    "betas": ("two numbers in [0, 1), as [0.9, 0.999]", _pair(lambda x: _real(x) and 0 <= x < 1)),
    "rho": ("a number in [0, 1]", lambda v: _real(v) and 0 <= v <= 1),
    "etas": ("two numbers, as [0.5, 1.2]", _pair(lambda x: _real(x) and x > 0)),
    "step_sizes": ("two numbers, as [1e-6, 50]", _pair(lambda x: _real(x) and x > 0)),
    "beta2_decay": ("a number <= 0", lambda v: _real(v) and v <= 0),
}
OWN_VALUES = {("adafactor", "eps")}  # Adafactor's eps is a pair (None allowed): torch checks it

# Which parameters get weight decay: by default every one, but under AdamW not the norms'
# weights and the biases (one value per channel: ndim <= 1), as timm does.
DECAY_KEY = "norm_and_bias_decay"
NO_NORM_AND_BIAS_DECAY = ("adamw",)

# torch.nn's losses by name, with the keyword arguments a recipe may give each (the reduction is
# the mean: a push's gradient is one batch's mean).
LOSSES: dict[str, tuple[str, tuple[str, ...]]] = {
    "cross_entropy": ("CrossEntropyLoss", ("label_smoothing", "ignore_index")),
    "nll": ("NLLLoss", ("ignore_index",)),
    "mse": ("MSELoss", ()),
    "l1": ("L1Loss", ()),
    "smooth_l1": ("SmoothL1Loss", ("beta",)),
    "huber": ("HuberLoss", ("delta",)),
    "bce_with_logits": ("BCEWithLogitsLoss", ()),
}

# The learning-rate schedules, as factors of the optimizer's rate by the PS's version (the
# updates applied): a linear warmup (torch's LinearLR) for `warmup` updates, then the main one.
SCHEDULES: dict[str, tuple[str, ...]] = {
    "constant": (),
    "cosine": ("eta_min",),  # CosineAnnealingLR over the rest of the run, down to eta_min (a rate)
    "step": ("step_size", "gamma"),  # StepLR: times gamma every step_size updates (or that fraction of the run)
    "linear": ("end_factor",),  # LinearLR from 1 to end_factor over the rest of the run
    # ReduceLROnPlateau on the headline metric at each evaluation (the main PS's)
    "plateau": ("mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "min_lr"),
}
WARMUP_KEYS = ("warmup", "warmup_start_factor")

METRICS = ("accuracy", "perplexity", "loss")  # the built-in evaluations; or package.module:function


class Problem(NamedTuple):
    """What is wrong with a spec: the key at fault ("" for the spec itself) and why."""

    key: str
    text: str


def spec_of(value: Any) -> Spec:
    """`value` (a name, a mapping with `name`, or a flag's text: a name or JSON) as a spec;
    ValueError saying what a spec is otherwise."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{value!r} is not valid JSON ({e.msg})") from None
        else:
            return {"name": text}
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        raise ValueError(f"{value!r} is not a name, nor a mapping with a name")
    return {"name": value["name"], **{k: v for k, v in value.items() if k != "name"}}


def spec_text(value: Spec) -> str:
    """A spec as a flag or variable carries it: its bare name, or compact JSON."""
    if set(value) == {"name"}:
        return str(value["name"])
    return json.dumps(value, separators=(",", ":"))


def _keys(value: Spec, allowed: tuple[str, ...], what: str) -> Optional[Problem]:
    for key in value:
        if key != "name" and key not in allowed:
            keys = ", ".join(("name", *allowed))
            return Problem(key, f"unknown key for {what}; allowed: {keys}")
    return None


def _name(value: Spec, names: Any, what: str) -> Optional[Problem]:
    name = value["name"]
    if name in names or ENTRY_POINT.match(name):
        return None
    return Problem("name", f"got {name!r}; must be one of {', '.join(names)}, or {what} package.module:factory")


def _positive(value: Spec, key: str) -> Optional[Problem]:
    v = value.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return Problem(key, f"got {v!r}; must be a number > 0")
    return None


def optimizer_problem(value: Spec) -> Optional[Problem]:
    """What is wrong with an optimizer spec; None when nothing is (the user's own factory takes
    any keyword; torch checks the values when the PS builds the optimizer)."""
    problem = _name(value, OPTIMIZERS, "your own optimizer as")
    if problem is not None or ENTRY_POINT.match(value["name"]):
        return problem
    keys = OPTIMIZERS[value["name"]][1] + (DECAY_KEY,)
    problem = _keys(value, keys, value["name"]) or _positive(value, "lr") or _values(value)
    if problem is None and DECAY_KEY in value and not isinstance(value[DECAY_KEY], bool):
        problem = Problem(DECAY_KEY, f"got {value[DECAY_KEY]!r}; must be true or false")
    return problem


def _values(value: Spec) -> Optional[Problem]:
    """The first key of a torch optimizer whose value is not one it takes."""
    for key, v in value.items():
        wanted = VALUES.get(key)
        if wanted is not None and (value["name"], key) not in OWN_VALUES and not wanted[1](v):
            return Problem(key, f"got {v!r}; must be {wanted[0]}")
    return None


def schedule_problem(value: Spec) -> Optional[Problem]:
    """What is wrong with a schedule spec; None when nothing is."""
    name = value["name"]
    users = ENTRY_POINT.match(name) is not None  # any keyword: the user's factory takes them
    if name not in SCHEDULES and not users:
        return Problem(
            "name", f"got {name!r}; must be one of {', '.join(SCHEDULES)}, or your own as package.module:factory"
        )
    problem = None if users else _keys(value, SCHEDULES[name] + WARMUP_KEYS, f"schedule {name}")
    if problem is not None:
        return problem
    for key in ("warmup", "step_size"):
        v = value.get(key)
        if v is not None and not _updates_or_fraction(v, allow_zero=key == "warmup"):
            return Problem(key, f"got {v!r}; must be a whole number of updates, or a fraction of the run in (0, 1)")
    for key, low, high in (("warmup_start_factor", 0.0, 1.0), ("end_factor", 0.0, 1.0), ("gamma", 0.0, math.inf)):
        v = value.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not low < v <= high):
            return Problem(key, f"got {v!r}; must be a number in ({low:g}, {high:g}]")
    for key in ("eta_min", "min_lr"):
        v = value.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            return Problem(key, f"got {v!r}; must be a rate >= 0")
    return _plateau_problem(value) if name == "plateau" else None


def _plateau_problem(value: Spec) -> Optional[Problem]:
    for key, allowed in (("mode", ("min", "max")), ("threshold_mode", ("rel", "abs"))):
        if key in value and value[key] not in allowed:
            return Problem(key, f"got {value[key]!r}; must be {' or '.join(allowed)}")
    v = value.get("factor")
    if v is not None and not (_real(v) and 0 < v < 1):
        return Problem("factor", f"got {v!r}; must be a number in (0, 1)")
    for key in ("patience", "cooldown"):
        v = value.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            return Problem(key, f"got {v!r}; must be a whole number of evaluations >= 0")
    v = value.get("threshold")
    if v is not None and not (_real(v) and v >= 0):
        return Problem("threshold", f"got {v!r}; must be a number >= 0")
    return None


def plateau_mode(schedule: Spec, metrics: str) -> str:
    """Whether a plateau schedule's headline should fall (`min`) or rise (`max`): its `mode`, else
    `max` for accuracy and `min` for every other evaluation (perplexity, loss, the user's)."""
    return str(schedule.get("mode") or ("max" if metrics == "accuracy" else "min"))


def _updates_or_fraction(v: Any, allow_zero: bool) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if isinstance(v, int):
        return v >= (0 if allow_zero else 1)
    return 0.0 < v < 1.0


def loss_problem(value: Spec) -> Optional[Problem]:
    """What is wrong with a loss spec; None when nothing is."""
    problem = _name(value, LOSSES, "your own loss as")
    if problem is not None or ENTRY_POINT.match(value["name"]):
        return problem
    return _keys(value, LOSSES[value["name"]][1], f"loss {value['name']}")


def metric_problem(name: str) -> Optional[Problem]:
    """What is wrong with a metrics name; None when nothing is."""
    if name in METRICS or ENTRY_POINT.match(name):
        return None
    return Problem("", f"got {name!r}; must be one of {', '.join(METRICS)}, or your own as package.module:function")


# --- resolving the optimizer against the run's lr, momentum and weight decay ---------------


class Optimizer(NamedTuple):
    """The optimizer a run steps with: its name, its keyword arguments (the rate among them)
    and whether norms and biases get weight decay."""

    name: str
    kwargs: dict[str, Any]
    norm_and_bias_decay: bool


def resolve_optimizer(value: Spec, lr: float, momentum: float, weight_decay: float) -> Optimizer:
    """The optimizer `value` names with the run's train.lr (unless the spec gives its own rate),
    and train.momentum and train.weight_decay where they are not zero (the spec may not give
    them too); ValueError naming the clash."""
    kwargs = {k: v for k, v in value.items() if k not in ("name", DECAY_KEY)}
    kwargs.setdefault("lr", lr)
    for key, given in (("momentum", momentum), ("weight_decay", weight_decay)):
        if not given:
            continue
        if key in value:
            raise ValueError(f"the optimizer gives {key} too ({value[key]}): give it once")
        known = OPTIMIZERS.get(value["name"])
        if known is not None and key not in known[1]:
            raise ValueError(f"{value['name']} has no {key}: leave it 0 and give the optimizer's own keys")
        kwargs[key] = given
    decay = value.get(DECAY_KEY, value["name"] not in NO_NORM_AND_BIAS_DECAY)
    return Optimizer(value["name"], kwargs, bool(decay))


def outer_optimizer(value: Spec, arrivals: bool, workers: int) -> Spec:
    """The optimizer a local strategy's PS steps with each change: train.outer_optimizer
    (`value`), its lr 0.7 unless it gives one. Under diloco_async (`arrivals`: each change applied
    as it arrives) SGD with Nesterov momentum and nothing else is delayed Nesterov
    (app/training/delayed_nesterov.py), its momentum stepped once every `workers` arrivals."""
    spec = {"lr": 0.7, **value}
    plain = set(spec) <= {"name", "lr", "momentum", "nesterov"}
    if arrivals and plain and spec["name"] == "sgd" and spec.get("nesterov") and spec.get("momentum"):
        return {"name": DELAYED_NESTEROV, "lr": spec["lr"], "momentum": spec["momentum"], "period": max(1, workers)}
    return spec


# --- the schedule ---------------------------------------------------------------------------


def planned_updates(
    strategy: str, epochs: int, epoch_batches: int, workers: int, max_steps: int, local_steps: int = 1
) -> int:
    """The updates a run plans when it starts, which its schedule spans: every batch of every
    epoch over the whole training split (`epoch_batches` a whole epoch's), one update each
    under async and ssp, one a round of `workers` batches under sync; each worker's --max_steps
    caps it. Under diloco and diloco_async a worker pushes once every `local_steps` of its
    batches (and its last ones), an update each, one a round of `workers` pushes under diloco.
    `make scale` does not change it. A stream with no declared length (`epoch_batches` 0)
    is planned by --max_steps alone."""
    kind = strategy_of(strategy)
    if kind.local:
        batches = epochs * math.ceil(epoch_batches / max(1, workers)) if epoch_batches > 0 else max_steps
        pushes = math.ceil((min(batches, max_steps) if max_steps else batches) / max(1, local_steps))
        return pushes if kind.rounds else pushes * max(1, workers)
    if epoch_batches <= 0:
        return max_steps if kind.rounds else max_steps * max(1, workers)
    if kind.rounds:
        total = epochs * math.ceil(epoch_batches / max(1, workers))
        return min(total, max_steps) if max_steps else total
    total = epochs * epoch_batches
    return min(total, max_steps * max(1, workers)) if max_steps else total


def _updates(v: Any, total: int) -> int:
    """A count of updates: as given, or a fraction of the run's total."""
    return v if isinstance(v, int) else int(v * total)


def lr_factor(schedule: Spec, version: int, total: int, base_lr: float) -> float:
    """The factor of the optimizer's rate for the update from `version` (0: the first), in a
    run of `total` updates: torch's LinearLR warmup, then the schedule's closed form
    (CosineAnnealingLR, StepLR, LinearLR); after `total` it holds the last value."""
    name = schedule["name"]
    warmup = _updates(schedule.get("warmup", 0), total)
    if version < warmup:
        start = float(schedule.get("warmup_start_factor", 1.0 / 3))
        return start + (1.0 - start) * version / warmup
    t, span = version - warmup, max(1, total - warmup)
    if name == "cosine":
        floor = float(schedule.get("eta_min", 0.0)) / base_lr
        return floor + (1.0 - floor) * (1.0 + math.cos(math.pi * min(t, span) / span)) / 2.0
    if name == "step":
        step = max(1, _updates(schedule.get("step_size", 1.0 / 3), total))
        return float(schedule.get("gamma", 0.1)) ** (t // step)
    if name == "linear":
        end = float(schedule.get("end_factor", 0.0))
        return 1.0 + (end - 1.0) * min(t, span) / span
    return 1.0
