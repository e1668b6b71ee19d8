"""The GPU regime's model (bench/sleep_model/sleep_resnet.py): ResNet-18's parameters, its compute a
sleep spread over the layers by FLOPs, forward first to last and backward last to first, with the
parameters' hooks firing during the backward. Checked in the model's own bookkeeping (what each layer
asked to sleep, in the order asked) and with a fake clock: no wall-clock assert."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from bench.gpu import CODE

sys.path.insert(0, str(CODE))
import sleep_resnet  # noqa: E402 - bench/sleep_model is the user's `code:` directory, not a package


def _backward(model: nn.Module, batch: int = 4) -> None:
    out = model(torch.randn(batch, 3, 32, 32))
    nn.functional.cross_entropy(out, torch.zeros(batch, dtype=torch.long)).backward()


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    """The model's sleeps on a fake clock: the tests read what was asked, and never wait."""
    clock = {"now": 0.0}
    # the module's own `time`, not the process's: a thread of an earlier test that sleeps must
    # neither move this clock nor be put on it
    fake = types.SimpleNamespace(
        monotonic=lambda: clock["now"], sleep=lambda s: clock.__setitem__("now", clock["now"] + s)
    )
    monkeypatch.setattr(sleep_resnet, "time", fake)
    return clock


def test_the_model_has_resnet18s_parameters_and_adds_a_gradient_into_each():
    from torchvision.models import resnet18

    model = sleep_resnet.resnet18_13ms(10, 3)
    real = resnet18(num_classes=10)
    assert [p.shape for p in model.parameters()] == [p.shape for p in real.parameters()]
    assert [b.shape for b in model.buffers()] == [b.shape for b in real.buffers()]
    for p in model.parameters():  # as the app's flat buffer: each .grad exists and is added into
        p.grad = torch.zeros_like(p)
    _backward(model)
    once = [p.grad.clone() for p in model.parameters()]
    assert all(g.abs().sum() > 0 for g in once)
    _backward(model)
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(model.parameters(), once))
    with pytest.raises(AttributeError):
        sleep_resnet.resnet18_fast  # noqa: B018 - not a factory name


def test_the_sleeps_sum_to_c_a_third_forward_and_each_layer_sleeps_its_flop_share():
    model = sleep_resnet.resnet18_25ms(10, 3)
    _backward(model)
    step = model.last_step
    assert [name for name, _ in step.forward] == model.layer_names and len(model.layer_names) == 41
    assert sum(s for _, s in step.forward) == pytest.approx(0.025 / 3)
    assert sum(s for _, s in step.backward) == pytest.approx(0.025 * 2 / 3)
    assert step.asked() == pytest.approx(0.025)
    forward, backward = dict(step.forward), dict(step.backward)
    assert all(backward[n] == pytest.approx(2 * forward[n]) for n in model.layer_names)
    # FLOPs at 3x32x32: conv1 (7x7, 3 -> 64, 16x16 out) against the head (512 -> 10, with bias)
    conv1, fc = 16 * 16 * 64 * 2 * 49 * 3, 10 * (2 * 512 + 1)
    assert forward["conv1"] / forward["fc"] == pytest.approx(conv1 / fc)
    shares = sleep_resnet.flop_shares(10, (3, 32, 32))
    assert sum(shares) == pytest.approx(1.0) and forward["conv1"] == pytest.approx(0.025 / 3 * shares[0])


def test_hooks_fire_during_the_backward_last_layer_first_spread_over_it():
    model = sleep_resnet.resnet18_13ms(10, 3)
    layer_of = {id(p): name for name, m in model.net.named_modules() for p in m.parameters(recurse=False)}
    fired: list[tuple[str, float]] = []  # (layer, seconds the backward had asked when the hook fired)

    def hook(p: torch.Tensor) -> None:
        fired.append((layer_of[id(p)], sum(s for _, s in model.last_step.backward)))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    _backward(model)
    order = list(dict.fromkeys(name for name, _ in fired))
    assert order == model.layer_names[::-1] == [name for name, _ in model.last_step.backward]
    assert len(fired) == len(list(model.parameters()))
    backward = dict(model.last_step.backward)
    asked_at = dict(fired)  # a layer's hooks fire after its own sleep and before the next layer's
    running = 0.0
    for name in order:
        running += backward[name]
        assert asked_at[name] == pytest.approx(running)
    assert asked_at["fc"] < 0.001 * 0.013 and asked_at["conv1"] == pytest.approx(0.013 * 2 / 3)
    assert asked_at["layer3.0.conv1"] == pytest.approx(0.013 * 2 / 3 / 2, rel=0.2)  # halfway


def test_each_pass_is_paced_so_overshooting_sleeps_do_not_add_up(no_sleep, monkeypatch):
    naps: list[float] = []

    def oversleep(seconds: float) -> None:  # every sleep ends 1 ms late
        naps.append(seconds)
        no_sleep["now"] += seconds + 0.001

    monkeypatch.setattr(sleep_resnet.time, "sleep", oversleep)
    pacer = sleep_resnet.Pacer()
    for _ in range(10):
        pacer.sleep(0.002)
    assert no_sleep["now"] == pytest.approx(0.021)  # 20 ms asked, one overshoot: not 30 ms
    assert naps[0] == pytest.approx(0.002) and naps[1] == pytest.approx(0.001)


def test_c_zero_asks_for_no_sleep_and_still_writes_every_gradient(monkeypatch):
    monkeypatch.setattr(sleep_resnet.time, "sleep", lambda s: pytest.fail(f"slept {s} s at C = 0"))
    model = sleep_resnet.resnet18_0ms(10, 3)
    _backward(model)
    assert model.last_step.asked() == 0.0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
