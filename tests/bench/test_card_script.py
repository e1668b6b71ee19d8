"""bench/card/run.sh, the card's proof in one run, tried as its header says before a card is lent:
on a CPU (DEVICE=cpu), its GPU tests part and its `bench cuda` part end 0 and leave their
files in OUT; a host without the carried wheels gets one line and the run goes on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_card_script_runs_its_parts_on_a_cpu_and_keeps_their_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "DEVICE": "cpu", "PARTS": "gpu-tests cuda", "OUT": str(out), "PY": sys.executable}
    p = subprocess.run(
        ["bash", str(ROOT / "bench/card/run.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=420
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ends = dict(re.findall(r"^== (\S+): exit (\d+) after", p.stdout, re.M))
    assert ends == {"gpu-tests": "0", "cuda": "0"}, p.stdout[-3000:]
    assert re.search(r"^torch \S+, CUDA \S+, no CUDA GPU, \d+ cores, Python 3\.", (out / "device.txt").read_text())
    assert "needs a CUDA GPU" in (out / "gpu-tests.log").read_text()  # the GPU tests say why they wait for a card
    rows = json.loads((out / "cuda" / "cuda.json").read_text())
    assert rows, "bench cuda wrote no rows"
    assert p.stdout.rstrip().endswith(f"everything is in {out}/")
