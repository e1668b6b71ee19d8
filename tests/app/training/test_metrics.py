"""The metrics file's `start` record: what a process trains, written by the app itself."""

from __future__ import annotations

from app.config import parse
from app.contract import EVENTS, RUN_ID_ENV, metrics_file
from app.training.metrics import MetricsWriter, read


def test_the_start_record_names_the_run_settings(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_ID_ENV, "run-7")
    config = parse(
        [
            "worker",
            "--rank",
            "2",
            "--world_size",
            "4",
            "--strategy",
            "ssp",
            "--batch_size",
            "16",
            "--model",
            "cnn",
            "--dataset",
            "digits",
            "--precision",
            "bf16",
            "--shards",
            "2",
        ],
        {},
    )
    with MetricsWriter(str(tmp_path), config.name, "worker", config.rank) as metrics:
        metrics.start(config, 5)
    [record] = read(tmp_path / metrics_file("worker2"))
    assert {k: v for k, v in record.items() if k != "time"} == {
        "role": "worker",
        "rank": 2,
        "event": "start",
        "step": 5,
        "name": "worker2",
        "strategy": "ssp",
        "batch_size": 16,
        "world_size": 4,
        "workers": 3,
        "shards": 2,
        "model": "cnn",
        "dataset": "digits",
        "precision": "bf16",
        "compress": "none",
        "run_id": "run-7",
    }
    assert record["event"] in EVENTS


def test_the_run_id_is_empty_when_unset(tmp_path, monkeypatch):
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    config = parse(["ps"], {})
    with MetricsWriter(str(tmp_path), config.name, "ps", 0) as metrics:
        metrics.start(config)
    assert read(tmp_path / "ps.jsonl")[0]["run_id"] == ""
