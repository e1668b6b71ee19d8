"""examples/wordlm, pytorch/examples' word_language_model ported: its corpus made by
make_data.py, then `ps-compose local` on its topology trains the LSTM (a PS and 2 workers as
processes, a few updates), scores the held-out split as perplexity and the test split once at
the end."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "wordlm"


@pytest.mark.slow
def test_the_ported_example_trains_as_processes_and_scores_its_test_split(tmp_path: Path) -> None:
    data = tmp_path / "data"
    made = subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), str(data)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in data.iterdir()) == ["test.txt", "train.txt", "valid.txt"]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "local",
            "-c",
            str(EXAMPLE / "topology.yaml"),
            f"train.data_dir={data}",
            f"code={EXAMPLE}",
            "train.max_steps=30",
            "train.eval_every=30",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    held_out = re.findall(r"^ps +\| Perplexity: ([0-9.]+)$", run.stdout, re.M)
    tested = re.findall(r"^ps +\| Test split: Perplexity: ([0-9.]+)$", run.stdout, re.M)
    assert held_out and tested, run.stdout[-2000:]
    assert 1 < float(tested[0]) < 2363  # better than a uniform guess over the vocabulary
