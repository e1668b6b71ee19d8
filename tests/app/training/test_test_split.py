"""A dataset factory that takes `split` gives a test split: the PS scores the final model on it
once, says so in its end line and record; a test split that disagrees with the held-out one on
num_classes stops the job at its start, in one line, exit 2. PS and a worker as processes."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest

from app_testkit import REPO, app_env, digits, job_args, run_app, run_cluster

CODE = """
    import torch
    from torch.utils.data import TensorDataset

    CALLS = []


    def _digits(split, classes=10):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16
        y = torch.tensor(y)
        part = {"train": slice(0, 1200), "val": slice(1200, 1500), "test": slice(1500, None)}[split]
        return TensorDataset(x[part], y[part]), 1, classes


    def three_splits(root, train, seed, split):
        assert train == (split == "train")
        return _digits(split)


    def disagreeing(root, train, seed, split):
        return _digits(split, classes=11 if split == "test" else 10)


    def no_test(root, train, seed, split):
        return None if split == "test" else _digits(split)
"""


def _job(tmp_path: Path, dataset: str) -> tuple[list[str], dict[str, str]]:
    code = tmp_path / "code" / "splits"
    code.mkdir(parents=True)
    (code / "__init__.py").write_text("")
    (code / "data.py").write_text(textwrap.dedent(CODE))
    env = app_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tmp_path / "code")])
    return digits(dataset=f"splits.data:{dataset}", num_epochs=3, lr=0.1, eval_every=100), env


def _end(tmp_path: Path) -> dict:
    records = [json.loads(line) for line in (tmp_path / "metrics" / "ps.jsonl").read_text().splitlines()]
    return [r for r in records if r["event"] == "end"][-1]


@pytest.mark.slow
def test_the_final_model_is_scored_once_on_the_test_split(tmp_path):
    args, env = _job(tmp_path, "three_splits")
    procs = run_cluster(tmp_path, workers=1, args=args, timeout=180, env=env)
    assert all(p.returncode == 0 for p in procs.values()), {n: p.stderr[-600:] for n, p in procs.items()}
    tested = re.findall(r"^Test split: Accuracy: ([0-9.]+)$", procs["ps"].stdout, re.M)
    assert len(tested) == 1 and float(tested[0]) >= 0.4, procs["ps"].stdout[-1500:]  # 10 classes: chance is 0.1
    end = _end(tmp_path)
    assert end["test_accuracy"] == pytest.approx(float(tested[0]), abs=1e-4) and "accuracy" in end


def test_a_factory_without_split_or_returning_none_gives_no_test_split(tmp_path, monkeypatch):
    from app import plugins

    _job(tmp_path, "no_test")
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    assert plugins.load_test_split("splits.data:no_test", "", 0) is None  # it said None for "test"
    assert plugins.load_test_split("splits.data:three_splits", "", 0).num_classes == 10
    assert not plugins.takes_split(lambda root, train, seed: None)  # the older contract: no split asked for
    assert plugins.load_dataset("splits.data:three_splits", "", True, 0).data.tensors[0].shape[0] == 1200


def test_a_test_split_that_disagrees_on_num_classes_stops_the_ps_at_its_start(tmp_path):
    """Before any worker joins: one line, exit 2 (the job stops on it: `local` stops every
    process, compose's `up` reports it and does not restart it)."""
    args, env = _job(tmp_path, "disagreeing")
    ps = run_app("ps", "--rank", "0", *job_args(tmp_path, 2), *args, env=env, timeout=90, fork=False)
    said = [line for line in ps.stderr.splitlines() if not re.match(r"^\d{4}-\d\d-\d\d ", line)]
    assert ps.returncode == 2, ps.stderr[-800:]
    assert said == [
        "app: error: --dataset splits.data:disagreeing: the test split gives num_classes 11; the held-out split "
        "the PS built its model from gives num_classes 10: every split must agree"
    ]
