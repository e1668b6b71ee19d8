"""bench/launch.py: a bench's run goes through the run handle every target shares, here on the
local target with a stand-in `app` package (a real launcher and real processes); what it
returns is the run's records, and a run that fails says which service and its last line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench import launch

pytestmark = pytest.mark.slow  # real launchers and processes

FAKE_APP = """
import json, os, sys, time
name = "ps" if sys.argv[1] == "ps" else "worker" + os.environ["PSC_RANK"]
with open(os.path.join(os.environ["PSC_METRICS_DIR"], name + ".jsonl"), "a") as f:
    f.write(json.dumps({"event": "end", "time": time.time(), "step": 7}) + "\\n")
if name == os.environ.get("FAKE_FAIL"):
    print(f"{name}: out of luck", flush=True)
    sys.exit(3)
"""


@pytest.fixture
def stand_in_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "__main__.py").write_text(FAKE_APP)
    monkeypatch.chdir(tmp_path)
    return yaml.safe_load((launch.ROOT / "configs" / "cpu-smoke.yaml").read_text()) | {"name": "bench-launch"}


def test_a_local_bench_run_returns_its_records_and_leaves_nothing_in_the_checkout(stand_in_app, tmp_path) -> None:
    files = launch.metrics("local", stand_in_app, timeout=60)
    assert set(files) == {"ps.jsonl", "worker1.jsonl", "worker2.jsonl"}
    assert yaml.safe_load(files["ps.jsonl"][0])["step"] == 7
    assert not (tmp_path / "runs").exists()


def test_a_bench_run_that_fails_names_the_service_and_its_last_line(stand_in_app, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_FAIL", "worker2")
    with pytest.raises(RuntimeError, match=r"ended badly \{.*'worker2': 3.*\}: worker2: worker2: out of luck"):
        launch.metrics("local", stand_in_app, timeout=60)
