"""PS + workers as real processes over RPC on 127.0.0.1 (CPU, built-in CNN, digits)."""

from __future__ import annotations

import re

import pytest
import torch

from app.training.metrics import read

from app_testkit import DIGITS, app_env, final_accuracy, run_cluster

CAP_SECONDS = 180  # the wall-clock cap for the whole run


@pytest.mark.slow
def test_two_workers_learn_digits_and_exit_cleanly(tmp_path):
    procs = run_cluster(tmp_path, workers=2, args=DIGITS, timeout=CAP_SECONDS, env=app_env(PSC_RUN_ID="run-1"))

    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr}"
    ps_out = procs["ps"].stdout
    assert final_accuracy(ps_out) >= 0.90
    assert re.search(r"^Time: \d+\.\d\d seconds$", ps_out, re.M), ps_out
    assert re.search(r"^Evaluation: \d+\.\d\d seconds$", ps_out, re.M), ps_out
    assert re.search(
        r"^ps \| Update: (\d+) \| Accuracy: 0\.\d{4} \| step \1 of \d+ \(\d+\.\d%\), \d+ samples/s, ETA \d+:\d\d:\d\d$",
        ps_out,
        re.M,
    ), ps_out
    for rank in (1, 2):
        assert re.search(
            rf"^worker{rank} \| Epoch: 10 \| Batch: \d+ \| Loss: \d+\.\d\d \| \d+ samples/s$",
            procs[f"worker{rank}"].stdout,
            re.M,
        )
    for name in ("ps", "worker1", "worker2"):  # what the process trains, written as it starts
        [start] = [r for r in read(tmp_path / "metrics" / f"{name}.jsonl") if r["event"] == "start"]
        assert {
            k: start[k]
            for k in (
                "name",
                "strategy",
                "batch_size",
                "world_size",
                "shards",
                "model",
                "dataset",
                "precision",
                "run_id",
            )
        } == {
            "name": name,
            "strategy": "async",
            "batch_size": 32,
            "world_size": 3,
            "shards": 1,
            "model": "cnn",
            "dataset": "digits",
            "precision": "fp32",
            "run_id": "run-1",
        }
    end = read(tmp_path / "metrics" / "ps.jsonl")[-1]
    assert end["event"] == "end" and end["accuracy"] == final_accuracy(ps_out)
    assert 0 < end["seconds"] and end["eval_seconds"] >= 0  # training time; evaluation apart
    final = torch.load(tmp_path / "checkpoints" / "final.pt")
    assert final["version"] == end["step"] > 0
    # every evaluation that knew the total (both ranks had pushed) knew it right: where the run ended
    totals = [r["total"] for r in read(tmp_path / "metrics" / "ps.jsonl") if r["event"] == "eval" and "total" in r]
    assert totals and set(totals) == {end["step"]}, totals
    assert set(final["model"]) == {
        "features.0.weight",
        "features.0.bias",
        "features.3.weight",
        "features.3.bias",
        "classifier.1.weight",
        "classifier.1.bias",
        "classifier.3.weight",
        "classifier.3.bias",
    }


@pytest.mark.slow
def test_no_update_lost_with_three_workers(tmp_path):
    args = DIGITS[:-6] + ["--num_epochs", "3", "--rpc_timeout", "30"]
    procs = run_cluster(tmp_path, workers=3, args=args, timeout=CAP_SECONDS)

    assert {p.name: p.returncode for p in procs.values()} == {"ps": 0, "worker1": 0, "worker2": 0, "worker3": 0}
    metrics = tmp_path / "metrics"
    pushes = {r: read(metrics / f"worker{r}.jsonl")[-1] for r in (1, 2, 3)}
    assert all(end["event"] == "end" and end["step"] > 0 for end in pushes.values())
    ps_end = read(metrics / "ps.jsonl")[-1]
    assert ps_end["event"] == "end"
    assert ps_end["step"] == sum(end["step"] for end in pushes.values())
    assert ps_end["pushes"] == {f"worker{r}": end["step"] for r, end in pushes.items()}
    train = [rec for r in (1, 2, 3) for rec in read(metrics / f"worker{r}.jsonl") if rec["event"] == "train"]
    assert all(rec["staleness"] >= 0 and rec["samples_per_s"] > 0 for rec in train)
