"""A recipe in real processes (a PS and a worker on 127.0.0.1): the user's own loss and metrics
from their code, and a run killed mid-schedule (AdamW, warmup + cosine, clipping) that resumes
from its checkpoint and ends with the very model of the run that was never stopped."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from app_testkit import app_env, digits, finished, job_args, run_cluster, start_app, wait_for

DIGITS = digits(seed=0)

USER_CODE = """
import torch
from torch import nn


def make_loss(mark, smoothing=0.0):
    with open(mark, "a") as f:
        f.write(f"built with smoothing {smoothing}\\n")
    return nn.CrossEntropyLoss(label_smoothing=smoothing)


def top2(model, batches, loss):
    hits = seen = 0
    for x, y in batches:
        best = model(x).topk(2, dim=-1).indices
        hits += int((best == y.unsqueeze(-1)).any(-1).sum())
        seen += len(y)
    return {"top2": hits / seen, "seen": seen}
"""


@pytest.mark.slow
def test_the_users_own_loss_and_metrics_from_their_code(tmp_path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "recipe_code.py").write_text(USER_CODE)
    mark = tmp_path / "mark"
    loss = json.dumps({"name": "recipe_code:make_loss", "mark": str(mark), "smoothing": 0.1})
    args = [*DIGITS, "--num_epochs", "3", "--lr", "0.1", "--loss", loss, "--metrics", "recipe_code:top2"]
    args += ["--eval_every", "50", "--rpc_timeout", "30"]
    env = app_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(code)])
    procs = run_cluster(tmp_path, 1, args, timeout=240, env=env)
    assert all(p.returncode == 0 for p in procs.values()), {n: p.stderr[-2000:] for n, p in procs.items()}
    headline = [line for line in procs["ps"].stdout.splitlines() if line.startswith("Top2: ")]
    assert len(headline) == 1 and float(headline[0].split()[1]) >= 0.95, procs["ps"].stdout[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics" / "ps.jsonl").read_text().splitlines()]
    end = [r for r in records if r["event"] == "end"][-1]
    assert end["metrics"] == ["top2", "seen"] and end["seen"] > 0
    assert "Update: 50 | Top2: " in procs["ps"].stdout
    # the PS and the worker each built the user's loss with its keyword arguments
    assert mark.read_text().splitlines() == ["built with smoothing 0.1"] * 2


RECIPE = [
    *DIGITS,
    "--num_epochs",
    "15",
    "--max_steps",
    "600",
    "--optimizer",
    '{"name": "adamw", "lr": 0.003, "weight_decay": 0.05}',
    "--schedule",
    '{"name": "cosine", "warmup": 20}',
    "--clip_grad_norm",
    "1.0",
    "--checkpoint_every",
    "100",
    "--eval_every",
    "1000",
    "--rpc_timeout",
    "20",
    "--run_id",
    "recipe",
]


def _job(tmp_path: Path) -> dict:
    common = [*job_args(tmp_path, 2), *RECIPE]
    return {
        "ps": start_app(tmp_path, "ps", ["ps", *common]),
        "worker1": start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common]),
    }


def _final(tmp_path: Path) -> dict:
    return torch.load(tmp_path / "checkpoints" / "final.pt", weights_only=True)


@pytest.mark.slow
def test_a_run_killed_mid_schedule_resumes_to_the_uninterrupted_runs_model(tmp_path) -> None:
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    whole.mkdir()
    broken.mkdir()
    procs = _job(whole)
    wait_for(procs, 240, "the uninterrupted run")
    assert all(p.returncode == 0 for p in procs.values()), finished(whole, "ps", procs["ps"]).stderr[-2000:]

    procs = _job(broken)
    deadline = time.monotonic() + 120
    while not list((broken / "checkpoints").glob("ckpt-*.pt")) and time.monotonic() < deadline:
        time.sleep(0.02)
    for proc in procs.values():  # killed between two checkpoints, mid-schedule
        proc.kill()
    wait_for(procs, 30, "the killed run")
    saved = sorted((broken / "checkpoints").glob("ckpt-*.pt"))
    assert saved and not (broken / "checkpoints" / "final.pt").exists(), "the run ended before it was killed"
    killed_at = torch.load(saved[-1], weights_only=True)["version"]
    assert 0 < killed_at < 600

    procs = _job(broken)  # the same run again: the PS resumes its checkpoint, the worker its batches
    wait_for(procs, 240, "the resumed run")
    assert all(p.returncode == 0 for p in procs.values()), finished(broken, "ps", procs["ps"]).stderr[-2000:]
    assert "resum" in finished(broken, "ps", procs["ps"]).stderr
    want, got = _final(whole), _final(broken)
    assert got["version"] == want["version"] == 600
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key


@pytest.mark.slow
def test_a_plateau_schedule_lowers_the_rate_at_each_evaluation_that_does_not_improve(tmp_path) -> None:
    # threshold 1.0, absolute: only an accuracy 1.0 above the best counts as better, so after the
    # first evaluation every one stalls and, with patience 0, halves the rate (down to min_lr)
    schedule = {"name": "plateau", "factor": 0.5, "patience": 0, "threshold": 1.0, "threshold_mode": "abs"}
    schedule["min_lr"] = 0.02
    args = [*DIGITS, "--num_epochs", "2", "--lr", "0.1", "--schedule", json.dumps(schedule), "--eval_every", "10"]
    procs = run_cluster(tmp_path, 1, args, timeout=240)
    assert all(p.returncode == 0 for p in procs.values()), {n: p.stderr[-2000:] for n, p in procs.items()}
    records = [json.loads(line) for line in (tmp_path / "metrics" / "ps.jsonl").read_text().splitlines()]
    rates = [r["lr"] for r in records if r["event"] == "eval"]
    assert rates[:5] == pytest.approx([0.1, 0.05, 0.025, 0.02, 0.02]), rates  # each record: the rate after its verdict
    assert "plateau: accuracy stalled; lr lowered to 0.05" in procs["ps"].stderr
