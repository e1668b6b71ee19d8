"""diloco and diloco_async as real PS and worker processes on digits: they learn, each worker
pushes once every local_steps batches (and its last ones), and the PS's checkpoint holds the
outer optimizer's state."""

from __future__ import annotations

import math

import pytest
import torch

from app.training.metrics import read

from app_testkit import DIGITS, run_cluster


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["diloco", "diloco_async"])
def test_a_local_strategy_learns_digits_with_a_push_every_local_steps_batches(strategy, tmp_path):
    steps, local = 58, 4  # of the 23 batches of each of a worker's 3 epochs
    args = [*DIGITS, "--strategy", strategy, "--local_steps", str(local), "--max_steps", str(steps)]
    args += ["--num_epochs", "3", "--optimizer", "adam", "--lr", "0.003", "--log_every", "5"]
    procs = run_cluster(tmp_path, workers=2, args=args, timeout=150)
    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr}"
    end = read(tmp_path / "metrics" / "ps.jsonl")[-1]
    pushes = math.ceil(steps / local)  # 14 of 4 batches, then the last 2
    assert end["pushes"] == {"worker1": pushes, "worker2": pushes}
    assert end["step"] == (pushes if strategy == "diloco" else 2 * pushes)  # a round each, or a change each
    # diloco's rounds do not depend on timing (0.897 every run); diloco_async's result depends on the
    # order the changes arrive in: 0.73 to 0.93 over 12 runs two at a time on a 2-core VM (chance: 0.1)
    assert end["accuracy"] >= (0.85 if strategy == "diloco" else 0.6)
    train = [r for r in read(tmp_path / "metrics" / "worker1.jsonl") if r["event"] == "train"]
    assert [r["step"] for r in train][:4] == [5, 10, 15, 20]  # a worker's step is a batch (of any epoch)
    assert [r["batch"] for r in train][:4] == [5, 10, 15, 20]
    final = torch.load(tmp_path / "checkpoints" / "final.pt", weights_only=True)
    state = final["optimizer"]["state"]
    assert state, "the outer optimizer's state is in the checkpoint"
    if strategy == "diloco_async":
        assert int(state[0]["arrivals"]) == 2 * pushes
    else:
        assert "momentum_buffer" in state[0]
