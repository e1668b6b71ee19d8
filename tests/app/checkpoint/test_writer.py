"""The checkpoint writer (app.checkpoint.writer): a finish on disk at once, a failed final write tried again."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.checkpoint import files as checkpoint_files
from app.checkpoint.writer import Checkpointer
from app.config import parse
from app.ps.server import ParameterServer
from app.training.metrics import MetricsWriter

from app_testkit import ps_server, push


def _linear(size: int, value: float = 0.0) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.constant_(model.weight, value)
    return model


def test_a_finish_is_checkpointed_at_once_and_survives_a_restart(tmp_path):
    config = parse(["ps", "--checkpoint_dir", str(tmp_path), "--checkpoint_every", "1000"], {})

    def server() -> ParameterServer:
        return ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, join_timeout=300)

    with MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0) as metrics:
        first = server()
        checkpoints = Checkpointer(first, config, {"model_name": "linear"}, metrics)
        checkpoints.resume()
        first.on_finish = checkpoints.finished
        first.join(1, "worker1")
        push(first, 1, torch.ones(4), 0)
        first.finish(1, 1, "worker1")
        restarted = server()
        Checkpointer(restarted, config, {"model_name": "linear"}, metrics).resume()
    assert restarted.members.finished == {1: 1} and restarted.version == 1


@pytest.mark.parametrize("then", ["room-made", "stopped"])
def test_a_failed_final_write_leaves_no_finished_checkpoint_and_is_tried_again(tmp_path, monkeypatch, then):
    """The PS holds the model while final.pt cannot be written (it was an OSError: the PS
    exited 1 and the model was lost). Each wait between tries is where room is made, or
    where SIGTERM comes (SystemExit): one more try, then the exit goes on."""
    from app.checkpoint import writer as checkpointer

    config = parse(["ps", "--checkpoint_dir", str(tmp_path)], {})
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=1)
    server.join(1, "worker1")
    push(server, 1, torch.ones(4), 0)
    server.finish(1, 1, "worker1")
    (tmp_path / "final.pt").mkdir()  # the rename onto it fails, as a full disk would
    waits = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        assert all(not checkpoint_files.verify(p)["finished"] for p in checkpoint_files.listing(tmp_path))
        if len(waits) == 2:
            if then == "stopped":
                raise SystemExit(143)
            (tmp_path / "final.pt").rmdir()

    monkeypatch.setattr(checkpointer.time, "sleep", wait)
    with MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0) as metrics:
        saver = Checkpointer(server, config, {}, metrics)
        if then == "stopped":
            with pytest.raises(SystemExit):
                saver.final()
        else:
            saver.final()
    assert waits == [checkpointer.RETRY_SECONDS] * 2
    finished = [checkpoint_files.verify(p)["finished"] for p in checkpoint_files.listing(tmp_path)]
    if then == "stopped":
        assert (tmp_path / "final.pt").is_dir() and not any(finished)
        return
    assert torch.load(tmp_path / "final.pt", weights_only=True)["version"] == 1 and finished == [True]
