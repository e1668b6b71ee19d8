"""The PS's optimizer on its flat vector (app/ps/optim.py through app/ps/state.py) is torch.optim's
on the model's own parameters: the same values over the same gradients, with the groups that
leave norms and biases out of weight decay, on one PS process and on two shards; the schedule's
rate at each version; clipping by the norm the push carries, alike on every shard; a restore
mid-schedule that continues as if never stopped."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from app.ps.optim import TorchOptimizer
from app.ps.sgd import SGD
from app.ps.sharding.slices import bounds
from app.ps.state import Plan, State, StateConfig
from app.recipes import resolve_optimizer
from app.training.flat import FlatModel, state_size

STEPS = 6


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3), nn.LayerNorm(3)
    )


def gradients(m: nn.Module) -> list[list[torch.Tensor]]:
    """A fixed sequence of gradients, one per parameter a step."""
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(p.shape, generator=g) for p in m.parameters()] for _ in range(STEPS)]


def reference(spec: dict, lr: float, grads: list[list[torch.Tensor]], decays_all: bool) -> torch.Tensor:
    """torch.optim on the model's own parameters: decay on every parameter, or not on norms and biases."""
    m = model()
    name = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[spec["name"]]
    kwargs = {k: v for k, v in spec.items() if k not in ("name", "norm_and_bias_decay")}
    kwargs.setdefault("lr", lr)
    if decays_all:
        groups = [{"params": list(m.parameters())}]
    else:
        named = list(m.named_parameters())
        groups = [
            {"params": [p for n, p in named if p.ndim > 1 and not n.endswith(".bias")]},
            {"params": [p for n, p in named if p.ndim <= 1 or n.endswith(".bias")], "weight_decay": 0.0},
        ]
    optimizer = getattr(torch.optim, name)(groups, fused=True, **kwargs)
    for step in grads:
        for p, g in zip(m.parameters(), step):
            p.grad = g.clone()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def message(m: nn.Module, step: list[torch.Tensor]) -> torch.Tensor:
    """A push's [grads | buffers] for the model `m` with these gradients."""
    flat = FlatModel(m, with_grads=False)
    return torch.cat([torch.cat([g.reshape(-1) for g in step]), flat.vector[flat.num_params :]])


def run_ps(spec: dict, lr: float, grads, shards: int = 1, **config) -> torch.Tensor:
    """The PS's parameter values after the steps, its state split over `shards` processes."""
    m = model()
    size = state_size(m)
    parts = bounds(size, shards) if shards > 1 else [None]
    states = [State(model(), StateConfig(lr, part=part, optimizer=spec, **config)) for part in parts]
    for step in grads:
        whole = message(m, step)
        for s in states:
            s.step(whole[s.part[0] : s.part[1]].clone())
    vector = torch.cat([s.vector for s in states])
    return vector[: FlatModel(m, with_grads=False).num_params]


SPECS = [
    ({"name": "sgd", "momentum": 0.9, "weight_decay": 0.01, "nesterov": True}, True),
    ({"name": "adam", "weight_decay": 0.01}, True),
    ({"name": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1}, False),  # adamw: no decay on norms, biases
    ({"name": "adamw", "weight_decay": 0.1, "norm_and_bias_decay": True}, True),
]


@pytest.mark.parametrize("spec,decays_all", SPECS, ids=lambda v: str(v) if isinstance(v, dict) else None)
@pytest.mark.parametrize("shards", [1, 2])
def test_the_ps_steps_its_vector_as_torch_optim_steps_the_models_parameters(spec, decays_all, shards) -> None:
    grads = gradients(model())
    want = reference(spec, 0.01, grads, decays_all)
    got = run_ps(dict(spec), 0.01, grads, shards)
    if shards == 1:
        assert torch.equal(got, want)
    else:  # a shard's cut through a parameter moves the fused kernel's vector/scalar tail: last bits
        torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-8)
        assert (got != want).sum() <= 4


def test_plain_sgd_settings_keep_the_ps_own_sgd_and_others_build_torch_optim() -> None:
    assert isinstance(State(model(), StateConfig(0.1, momentum=0.9)).optimizer, SGD)
    assert isinstance(State(model(), StateConfig(0.1, optimizer={"name": "adamw"})).optimizer, TorchOptimizer)
    decayed = {"name": "sgd", "weight_decay": 0.1, "norm_and_bias_decay": False}
    assert isinstance(State(model(), StateConfig(0.1, optimizer=decayed)).optimizer, TorchOptimizer)


def test_the_optimizer_state_of_a_shard_is_its_slice() -> None:
    size = state_size(model())
    parts = bounds(size, 2)
    states = [State(model(), StateConfig(0.01, part=p, optimizer={"name": "adamw"})) for p in parts]
    m = model()
    for step in gradients(m)[:1]:
        whole = message(m, step)
        for s in states:
            s.step(whole[s.part[0] : s.part[1]].clone())
    held = [sum(t["exp_avg"].numel() for t in s.checkpoint()["optimizer"]["state"].values()) for s in states]
    assert held == [s.num_params for s in states] and sum(held) == FlatModel(m, with_grads=False).num_params


def schedule_state(schedule: dict, epochs: int = 1, epoch_batches: int = 40, **config) -> State:
    s = State(
        model(),
        StateConfig(
            0.1,
            schedule=schedule,
            plan=Plan("async", epochs),
            **{"optimizer": {"name": "sgd", "momentum": 0.9}, **config},
        ),
    )
    s.plan(epoch_batches)
    return s


def torch_rates(build, total: int) -> list[float]:
    """The rate torch's scheduler gives each update of a `total`-update run."""
    p = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.1)
    scheduler = build(optimizer)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


SCHEDULES = {
    "warmup+cosine": (
        {"name": "cosine", "warmup": 8, "warmup_start_factor": 0.1, "eta_min": 0.001},
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=8),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=32, eta_min=0.001),
            ],
            milestones=[8],
        ),
    ),
    "step": (
        {"name": "step", "step_size": 10, "gamma": 0.5},
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5),
    ),
    "linear": (
        {"name": "linear", "end_factor": 0.25},
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=1.0, end_factor=0.25, total_iters=40),
    ),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_rate_at_each_version_is_torchs_schedulers(name) -> None:
    schedule, build = SCHEDULES[name]
    s = schedule_state(schedule)
    assert s.total == 40
    m = model()
    rates = []
    for step in gradients(m) * 7:
        rates.append(s.lr)
        s.step(message(m, step))
        if len(rates) == 40:
            break
    assert rates == pytest.approx(torch_rates(build, 40), rel=1e-12, abs=1e-15)


HEADLINES = [0.5, 0.6, 0.6, 0.59, 0.61, 0.61, 0.6, 0.6, 0.7, 0.7, 0.69, 0.69]  # accuracy at each evaluation


@pytest.mark.parametrize("metrics, mode", [("accuracy", "max"), ("perplexity", "min")])
def test_a_plateau_schedule_lowers_the_rate_as_torchs_reducelronplateau_on_the_headline(metrics, mode) -> None:
    schedule = {"name": "plateau", "factor": 0.5, "patience": 1, "cooldown": 1, "min_lr": 0.02}
    s = schedule_state(schedule, metrics=metrics)
    p = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.1)
    torch_plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode=mode, factor=0.5, patience=1, cooldown=1, min_lr=0.02
    )
    headlines = HEADLINES if mode == "max" else [1 / h for h in HEADLINES]
    ours, theirs = [], []
    for value in headlines:
        s.observe(value)
        torch_plateau.step(value)
        ours.append(s.lr)
        theirs.append(optimizer.param_groups[0]["lr"])
    assert ours == pytest.approx(theirs, rel=1e-12) and min(ours) == pytest.approx(0.02) and ours[-1] < ours[0]
    # ...and a restored PS goes on from where the schedule was
    resumed = schedule_state(schedule, metrics=metrics)
    resumed.restore(copy.deepcopy(s.checkpoint()))
    assert resumed.lr == s.lr
    for value in headlines[:4]:
        assert resumed.observe(value) == s.observe(value) and resumed.lr == s.lr


def test_a_fraction_of_the_run_and_the_plan_of_a_sync_run() -> None:
    s = schedule_state({"name": "cosine", "warmup": 0.25}, epochs=2, epoch_batches=10)
    assert s.total == 20 and s.lr == pytest.approx(0.1 / 3)
    sync = State(model(), StateConfig(0.1, schedule={"name": "cosine"}, plan=Plan("sync", 3, workers=4, max_steps=0)))
    sync.plan(10)
    assert sync.total == 3 * 3  # ceil(10 / 4) rounds an epoch
    capped = State(
        model(), StateConfig(0.1, schedule={"name": "cosine"}, plan=Plan("async", 9, workers=2, max_steps=5))
    )
    capped.plan(10)
    assert capped.total == 10  # max_steps pushes by each of 2 workers


def test_a_stream_without_a_length_is_planned_by_max_steps_and_without_it_not_at_all() -> None:
    stream = State(
        model(), StateConfig(0.1, schedule={"name": "cosine"}, plan=Plan("async", 9, workers=2, max_steps=5))
    )
    stream.plan(0)  # its pushes say no epoch's batches
    assert stream.total == 10
    unplanned = State(model(), StateConfig(0.1, schedule={"name": "cosine"}, plan=Plan("async", 9, workers=2)))
    unplanned.plan(0)
    assert unplanned.total is None


def test_a_restored_ps_continues_the_schedule_and_the_optimizer_as_if_never_stopped() -> None:
    spec = {"name": "adamw", "weight_decay": 0.05}
    schedule = {"name": "cosine", "warmup": 3}
    m = model()
    grads = gradients(m) * 2
    whole = schedule_state(schedule, optimizer=spec)
    first = schedule_state(schedule, optimizer=spec)
    for step in grads[:5]:
        whole.step(message(m, step))
        first.step(message(m, step))
    saved = copy.deepcopy(first.checkpoint())
    resumed = State(model(), StateConfig(0.1, optimizer=spec, schedule=schedule, plan=Plan("async", 1)))
    resumed.restore(saved)
    assert (resumed.version, resumed.total, resumed.lr) == (whole.version, whole.total, whole.lr)
    for step in grads[5:]:
        whole.step(message(m, step))
        resumed.step(message(m, step))
    assert torch.equal(resumed.vector, whole.vector)


def test_clipping_scales_a_push_by_its_norm_alike_on_every_shard() -> None:
    m = model()
    grads = gradients(m)
    ref = model()
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in grads:
        for p, g in zip(ref.parameters(), step):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        optimizer.step()
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    for shards in (1, 2):
        parts = bounds(state_size(m), shards) if shards > 1 else [None]
        states = [State(model(), StateConfig(0.01, part=part, clip_grad_norm=1.0)) for part in parts]
        for step in grads:
            norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in step])))
            whole = message(m, step)
            for s in states:
                s.step(whole[s.part[0] : s.part[1]].clone(), s.scale_for(0, norm))
        got = torch.cat([s.vector for s in states])[: want.numel()]
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), shards
        assert torch.equal(torch.cat([s.vector for s in states]), torch.cat([s.vector for s in states]))
    assert State(m, StateConfig(0.01, clip_grad_norm=1.0)).clip_factor(0.5) == 1.0


def test_the_recipe_resolves_train_lr_momentum_and_weight_decay() -> None:
    assert resolve_optimizer({"name": "sgd"}, 0.1, 0.9, 0.0).kwargs == {"lr": 0.1, "momentum": 0.9}
    assert resolve_optimizer({"name": "adamw", "lr": 3e-4}, 0.1, 0.0, 0.0).kwargs == {"lr": 3e-4}
    assert resolve_optimizer({"name": "adamw"}, 0.1, 0.0, 0.0).norm_and_bias_decay is False
    with pytest.raises(ValueError, match="adamw has no momentum"):
        resolve_optimizer({"name": "adamw"}, 0.1, 0.9, 0.0)


USER_SCHEDULE = """
import torch


def build(optimizer, total, gamma=0.5):
    return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma)
"""


def test_the_users_own_schedule_is_its_torch_scheduler_stepped_once_an_update(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_schedules.py").write_text(USER_SCHEDULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    schedule = {"name": "my_schedules:build", "gamma": 0.9}
    s = schedule_state(schedule)
    m = model()
    rates = []
    for step in (gradients(m) * 2)[:10]:
        rates.append(s.lr)
        s.step(message(m, step))
    assert rates == pytest.approx(torch_rates(lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9), 10))
    resumed = schedule_state(schedule)
    resumed.restore(copy.deepcopy(s.checkpoint()))
    assert resumed.lr == pytest.approx(s.lr)
    step = gradients(m)[0]
    s.step(message(m, step))
    resumed.step(message(m, step))
    assert resumed.lr == pytest.approx(s.lr) and torch.equal(resumed.vector, s.vector)


def test_a_schedule_factory_that_returns_no_scheduler_stops_the_ps_as_it_starts(tmp_path, monkeypatch) -> None:
    from app.config import UsageError

    (tmp_path / "bad_schedules.py").write_text("def build(optimizer, total):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=r"^--schedule bad_schedules:build: returned a float; must return a torch"):
        State(model(), StateConfig(0.1, schedule={"name": "bad_schedules:build"}, plan=Plan("async", 1)))


def test_a_resumed_run_with_a_longer_plan_spans_it_instead_of_holding_the_old_end() -> None:
    schedule = {"name": "cosine"}
    short = State(model(), StateConfig(0.1, schedule=schedule, plan=Plan("async", 9, workers=1, max_steps=20)))
    short.plan(40)
    m = model()
    for step in (gradients(m) * 5)[:25]:  # past its plan: the cosine's end, a rate of 0
        short.step(message(m, step))
    assert short.total == 20 and short.lr == 0.0
    longer = State(model(), StateConfig(0.1, schedule=schedule, plan=Plan("async", 9, workers=1, max_steps=100)))
    longer.restore(copy.deepcopy(short.checkpoint()))
    assert longer.total == 20  # the checkpoint's, until a push says the epoch's batches
    longer.plan(40)
    assert longer.total == 100 and longer.version == 25
    assert longer.lr == pytest.approx(0.1 * (1 + math.cos(math.pi * 25 / 100)) / 2)
    same = State(model(), StateConfig(0.1, schedule=schedule, plan=Plan("async", 9, workers=1, max_steps=20)))
    same.restore(copy.deepcopy(short.checkpoint()))
    same.plan(40)
    assert same.total == 20 and same.lr == 0.0
