"""A run's recipe as data (app/recipes.py): the tables of torch's optimizers and losses hold the
installed torch's keyword arguments; a bad name or key is one line naming it, from the app's
flags (exit 2) and from a topology alike; the losses and evaluations build from their names."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from app import recipes
from app.config import UsageError, parse
from app.training import evaluate, losses

# What the PS or the run decides, never a recipe's key.
NOT_RECIPE_KEYS = {"self", "params", "capturable", "differentiable"}


@pytest.mark.parametrize("name", recipes.OPTIMIZERS)
def test_each_optimizers_keys_are_torchs(name) -> None:
    cls_name, keys = recipes.OPTIMIZERS[name]
    cls = getattr(torch.optim, cls_name)
    assert cls_name.lower() == name
    assert set(keys) == set(inspect.signature(cls.__init__).parameters) - NOT_RECIPE_KEYS


@pytest.mark.parametrize("name", recipes.OPTIMIZERS)
def test_each_optimizers_own_defaults_pass_the_value_checks_and_build(name) -> None:
    cls = getattr(torch.optim, recipes.OPTIMIZERS[name][0])
    defaults = {
        k: v.default
        for k, v in inspect.signature(cls.__init__).parameters.items()
        if k not in NOT_RECIPE_KEYS and v.default is not inspect.Parameter.empty and v.default is not None
    }
    defaults = {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()}
    assert recipes.optimizer_problem({"name": name, **defaults}) is None
    cls([torch.zeros(2, requires_grad=True)], **defaults)


@pytest.mark.parametrize(
    "spec,key",
    [
        ({"name": "adam", "betas": [0.9]}, "betas"),
        ({"name": "adamw", "betas": [0.9, 1.5]}, "betas"),
        ({"name": "adam", "eps": -1}, "eps"),
        ({"name": "sgd", "nesterov": "yes"}, "nesterov"),
        ({"name": "sgd", "momentum": float("nan")}, "momentum"),
        ({"name": "adadelta", "rho": 2}, "rho"),
        ({"name": "rprop", "etas": [0.5]}, "etas"),
    ],
)
def test_a_value_torch_would_refuse_or_choke_on_is_named_with_what_it_must_be(spec, key) -> None:
    problem = recipes.optimizer_problem(spec)
    assert problem is not None and problem.key == key and "must be" in problem.text


@pytest.mark.parametrize("name", recipes.LOSSES)
def test_each_losses_keys_are_torchs(name) -> None:
    cls_name, keys = recipes.LOSSES[name]
    assert set(keys) <= set(inspect.signature(getattr(nn, cls_name).__init__).parameters)


def test_every_loss_builds_and_a_class_loss_takes_a_sequence_position_by_position() -> None:
    for name in recipes.LOSSES:
        assert callable(losses.build({"name": name}))
    ce = losses.build({"name": "cross_entropy", "label_smoothing": 0.1})
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    want = nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), label_smoothing=0.1)
    assert torch.allclose(ce(logits, targets), want)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--optimizer", "adamx"], "--optimizer: name: got 'adamx'; must be one of sgd, adam, adamw"),
        (
            ["--optimizer", '{"name": "adamw", "beta": 0.9}'],
            "--optimizer: beta: unknown key for adamw; allowed: name, lr",
        ),
        (["--optimizer", '{"lr": 1}'], "--optimizer: {'lr': 1} is not a name, nor a mapping with a name"),
        (["--optimizer", "{nope"], "--optimizer: '{nope' is not valid JSON"),
        (["--schedule", "cosin"], "--schedule: name: got 'cosin'; must be one of constant, cosine, step, linear"),
        (["--schedule", '{"name": "step", "gamma": 2, "warmup": 1.5}'], "--schedule: warmup: got 1.5; must be"),
        (["--schedule", '{"name": "plateau", "factor": 2}'], "--schedule: factor: got 2; must be a number in (0, 1)"),
        (["--schedule", '{"name": "plateau", "mode": "up"}'], "--schedule: mode: got 'up'; must be min or max"),
        (
            ["--schedule", "plateau", "--shards", "2"],
            "--schedule: got plateau; plateau follows the main PS's evaluations",
        ),
        (["--loss", '{"name": "mse", "beta": 1}'], "--loss: beta: unknown key for loss mse; allowed: name"),
        (["--metrics", "bleu"], "--metrics: got 'bleu'; must be one of accuracy, perplexity, loss"),
        (["--clip_grad_norm", "-1"], "--clip_grad_norm: -1.0 must be >= 0"),
    ],
)
def test_a_bad_recipe_flag_is_one_line_naming_the_key(argv, message) -> None:
    with pytest.raises(UsageError) as error:
        parse(["worker", *argv], {})
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_bad_recipe_key_exits_2_with_one_line() -> None:
    from app_testkit import run_app

    out = run_app("worker", "--optimizer", '{"name": "adamw", "momentum": 0.9}')
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "app: error: --optimizer: momentum: unknown key for adamw; allowed: name, lr, betas, eps, weight_decay, "
        "amsgrad, maximize, foreach, fused, norm_and_bias_decay"
    ]


def test_a_recipe_from_the_environment_is_named_by_its_variable() -> None:
    with pytest.raises(UsageError, match=r"^PSC_OPTIMIZER: name: got 'x'"):
        parse(["worker"], {"PSC_OPTIMIZER": "x"})
    assert parse(["worker"], {"PSC_OPTIMIZER": '{"name":"adamw","lr":0.001}'}).optimizer == {
        "name": "adamw",
        "lr": 0.001,
    }


def test_the_built_in_evaluations_give_their_headline_first() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]
    ce = nn.CrossEntropyLoss()
    acc = evaluate.accuracy(model, data, ce)
    ppl = evaluate.perplexity(model, data, ce)
    assert list(acc) == ["accuracy", "loss"] and list(ppl) == ["perplexity", "loss"]
    assert ppl["perplexity"] == pytest.approx(torch.tensor(acc["loss"]).exp().item())
    assert evaluate.line(ppl).startswith("Perplexity: ")
    with pytest.raises(UsageError, match="must return a non-empty dict"):
        evaluate.checked("pkg.m:f", [0.5])
