"""The worker's training loop (app.worker.trainer) against a channel whose pushes go nowhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.config import parse
from app.exchange.wire import Refusal
from app.worker.trainer import MAX_REFUSED_IN_A_ROW, Trainer

from app_testkit import recording_channel, started


def _linear(size: int, value: float = 0.0) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.constant_(model.weight, value)
    return model


def test_a_worker_skips_refused_pushes_and_gives_up_after_a_run_of_them():
    config = parse(["worker"], {})

    channel = recording_channel(lambda message, version: Refusal("nonfinite", "worker1 pushed non-finite values"))
    trainer = Trainer(config, _linear(4), None, None, torch.device("cpu"), channel, None)
    started(trainer)
    for _ in range(MAX_REFUSED_IN_A_ROW - 1):
        assert trainer.push_and_pull() is None
    assert trainer.refused == MAX_REFUSED_IN_A_ROW - 1 and trainer.pushes == 0
    with pytest.raises(RuntimeError, match=f"{MAX_REFUSED_IN_A_ROW} pushes in a row were refused"):
        trainer.push_and_pull()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        # 3 epochs of 4 batches from the start: 11 pushes after the first, down to none after the last
        ([], [11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]),
        # --max_steps 5: five pushes in all, whatever the epochs hold
        (["--max_steps", "5"], [4, 3, 2, 1, 0]),
    ],
)
def test_each_push_says_the_pushes_its_rank_has_still_to_make(flags, expected):
    config = parse(["worker", "--num_epochs", "3", *flags], {})
    channel = recording_channel()
    batches = [None] * 4  # an epoch of 4 batches: all that to_go reads of the loader is its length
    trainer = Trainer(config, _linear(4), batches, None, torch.device("cpu"), channel, None)
    started(trainer)
    for epoch in range(1, 4):
        for batch in range(1, 5):
            trainer.push_and_pull(epoch, batch, 8)
            if trainer.reached_max_steps():
                break
        else:
            continue
        break
    assert channel.to_go == expected


def test_a_loader_without_a_length_leaves_the_pushes_to_go_unknown():
    config = parse(["worker"], {})
    channel = recording_channel()
    trainer = Trainer(config, _linear(4), None, None, torch.device("cpu"), channel, None)
    started(trainer)
    trainer.push_and_pull(1, 1, 8)
    assert channel.to_go == [-1]


def test_with_clipping_each_push_carries_its_gradients_global_norm_and_the_epochs_batches():
    """train.clip_grad_norm: the worker computes the norm of the gradient it pushes (the PS scales
    by it, every shard alike: tests/app/ps/test_optim.py); without clipping, none is sent."""
    model = _linear(4, 1.0)
    x, y = torch.ones(8, 4), torch.zeros(8, 1)
    for flags, norm_sent in ((["--clip_grad_norm", "0.5"], True), ([], False)):
        config = parse(["worker", "--loss", "mse", "--batch_size", "8", *flags], {})
        channel = recording_channel()
        trainer = Trainer(config, model, [(x, y)] * 3, None, torch.device("cpu"), channel, None)
        started(trainer)
        trainer.compute_gradients(x, y)
        grads = trainer.flat.grads.clone()
        trainer.push_and_pull(1, 1, 8)
        if norm_sent:
            assert channel.norms == [pytest.approx(float(torch.linalg.vector_norm(grads)))]
            assert channel.norms[0] > 0.5  # a gradient the PS will clip
        else:
            assert channel.norms == [None]


def test_a_cpu_workers_push_says_its_values_are_finite_only_when_they_are():
    config = parse(["worker"], {})
    channel = recording_channel()
    model = nn.Linear(3, 2)
    trainer = Trainer(config, model, None, None, torch.device("cpu"), channel, None)
    started(trainer)
    y = torch.zeros(4, dtype=torch.long)
    trainer.compute_gradients(torch.randn(4, 3), y)
    trainer.push_and_pull()
    bad = torch.randn(4, 3)
    bad[1, 2] = float("inf")
    trainer.compute_gradients(bad, y)
    trainer.push_and_pull()
    # the second push goes unproven: its PS checks every value and refuses it
    assert channel.proven == [True, False]
    assert not torch.isfinite(channel.messages[1]).all()


def test_a_local_strategys_change_is_never_sent_as_proven():
    config = parse(["worker", "--strategy", "diloco", "--local_steps", "1"], {})
    channel = recording_channel()
    trainer = Trainer(config, nn.Linear(3, 2), None, None, torch.device("cpu"), channel, None)
    started(trainer)
    trainer.compute_gradients(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))
    assert trainer.due(4)
    trainer.push_and_pull(1, 1, 4)
    assert channel.proven == [False]
