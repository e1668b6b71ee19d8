"""A user's dataset factory that returns a torch IterableDataset (a stream), trained on by the PS
and 2 workers as processes: each sample once an epoch across the workers; without a length and
without max_steps, one line and exit 2."""

from __future__ import annotations

import collections
import os
import re
import textwrap
from pathlib import Path

import pytest

from app_testkit import REPO, app_env, digits, run_cluster

CODE = """
    import os

    import torch
    from torch import nn
    from torch.utils.data import IterableDataset

    SIZE = 120


    class Numbered(IterableDataset):
        # sample i: its number in the first value, its class i % 4
        def __iter__(self):
            for i in range(SIZE):
                x = torch.randn(1, 8, 8) * 0.1
                x[0, 0, 0] = float(i)
                yield x, i % 4


    class Sized(Numbered):
        def __len__(self):
            return SIZE


    def sized(root, train, seed):
        return Sized(), 1, 4


    def endless(root, train, seed):
        return Numbered(), 1, 4


    class Recorder(nn.Module):
        # writes the number of every sample it trains on (not evaluates) to a file of its process
        def __init__(self, num_classes, channels):
            super().__init__()
            self.linear = nn.Linear(channels * 64, num_classes)

        def forward(self, x):
            if self.training:
                with open(os.path.join(os.environ["SEEN_DIR"], str(os.getpid())), "a") as seen:
                    seen.write("".join(f"{int(v)}\\n" for v in x[:, 0, 0, 0].tolist()))
            return self.linear(x.flatten(1))


    def recorder(num_classes, channels):
        return Recorder(num_classes, channels)
"""


def _job(tmp_path: Path, dataset: str, **flags: object) -> tuple[list[str], dict[str, str]]:
    code = tmp_path / "code" / "streams"
    code.mkdir(parents=True)
    (code / "__init__.py").write_text("")
    (code / "data.py").write_text(textwrap.dedent(CODE))
    seen = tmp_path / "seen"
    seen.mkdir()
    env = app_env(SEEN_DIR=str(seen))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tmp_path / "code")])
    args = digits(model="streams.data:recorder", dataset=f"streams.data:{dataset}", batch_size=8, rpc_timeout=30)
    return [*args, *(item for k, v in flags.items() for item in (f"--{k}", str(v)))], env


def _said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not re.match(r"^\d{4}-\d\d-\d\d ", line)]


@pytest.mark.slow
def test_a_stream_with_a_length_trains_each_sample_once_an_epoch_across_two_workers(tmp_path):
    args, env = _job(tmp_path, "sized", num_epochs=2, lr=0.05, eval_every=100)
    procs = run_cluster(tmp_path, workers=2, args=args, timeout=120, env=env)
    assert all(p.returncode == 0 for p in procs.values()), {n: p.stderr[-400:] for n, p in procs.items()}
    by_process = {f.name: f.read_text().split() for f in (tmp_path / "seen").iterdir()}
    assert len(by_process) == 2  # the two workers' training processes, nothing from the PS
    times = collections.Counter(int(i) for seen in by_process.values() for i in seen)
    assert times == {i: 2 for i in range(120)}  # 2 epochs: each sample twice, once an epoch
    shares = [set(map(int, seen)) for seen in by_process.values()]
    assert not shares[0] & shares[1]  # every other sample each: a worker's share


@pytest.mark.slow
def test_a_stream_with_neither_a_length_nor_max_steps_stops_the_job_with_one_line(tmp_path):
    args, env = _job(tmp_path, "endless", num_epochs=1)
    procs = run_cluster(tmp_path, workers=2, args=args, timeout=90, env=env)
    line = (
        "app: error: the training dataset is a stream with no declared length: give it a __len__ (its samples a "
        "pass) or give --max_steps (train.max_steps), which plan the run"
    )
    for name in ("worker1", "worker2"):
        assert procs[name].returncode == 2 and _said(procs[name].stderr) == [line], procs[name].stderr
    ps = _said(procs["ps"].stderr)
    assert procs["ps"].returncode == 2 and len(ps) == 1 and ps[0].startswith(line), procs["ps"].stderr
