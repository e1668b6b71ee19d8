"""`--precision` / `train.precision`: autocast on the workers; parameters and pushes stay float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from app.config import UsageError, parse
from app.runtime import devices
from app.training import models
from app.worker.trainer import Trainer
from orchestrator.render import compose as render_compose
from orchestrator.topology.model import TopologyError, load
from orchestrator.topology.model import parse as parse_topology

from app_testkit import (
    DIGITS,
    REPO,
    final_accuracy,
    finished,
    job_args,
    recording_channel,
    run_cluster,
    start_app,
    started,
    wait_for,
)


def test_precision_flag_and_fp16_needs_cuda():
    assert parse(["worker"], {}).precision == "fp32"
    assert parse(["worker", "--precision", "bf16"], {}).precision == "bf16"
    assert parse(["ps", "--precision", "fp16"], {}).precision == "fp16"  # the PS runs no forward
    with pytest.raises(UsageError, match="--precision: got fp16; needs a GPU, device cuda"):
        parse(["worker", "--precision", "fp16"], {})
    with pytest.raises(UsageError, match="--precision: 'fp8' is not one of fp32, bf16, fp16"):
        parse(["worker", "--precision", "fp8"], {})


def test_bf16_autocast_on_cpu_keeps_parameters_and_the_pushed_gradient_float32():
    config = parse(["worker", "--precision", "bf16"], {})
    model = models.build("cnn", 1, 10, seed=0)
    trainer = Trainer(config, model, None, None, torch.device("cpu"), recording_channel(), None)
    started(trainer)
    with devices.autocast("bf16", torch.device("cpu")):
        assert model(torch.randn(2, 1, 8, 8)).dtype == torch.bfloat16  # autocast is on
    loss = trainer.compute_gradients(torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3]))
    assert float(loss) > 0 and trainer.flat.message.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert trainer.flat.grads.abs().sum() > 0


def test_precision_renders_only_when_not_fp32():
    smoke = load(REPO / "configs/cpu-smoke.yaml")
    doc = yaml.safe_load(render_compose.dump(render_compose.render(smoke), "cpu-smoke"))
    assert all("PSC_PRECISION" not in s.get("environment", {}) for s in doc["services"].values())
    bf16 = smoke.model_copy(update={"train": dataclasses.replace(smoke.train, precision="bf16")})
    doc = yaml.safe_load(render_compose.dump(render_compose.render(bf16), "cpu-smoke"))
    assert {s["environment"]["PSC_PRECISION"] for s in doc["services"].values() if "environment" in s} == {"bf16"}


def test_fp16_on_a_cpu_image_is_refused():
    doc = yaml.safe_load((REPO / "configs/cpu-smoke.yaml").read_text())
    doc["train"]["precision"] = "fp16"
    with pytest.raises(TopologyError, match="train.precision: got 'fp16'; needs a GPU, device cuda"):
        parse_topology(yaml.safe_dump(doc), "t.yaml")


@pytest.mark.slow
def test_bf16_ps_and_workers_learn_digits_as_fp32_does(tmp_path):
    procs = run_cluster(tmp_path, workers=2, args=DIGITS + ["--precision", "bf16"], timeout=180)
    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr}"
    assert final_accuracy(procs["ps"].stdout) >= 0.90  # the fp32 cluster test's threshold


@pytest.mark.slow
def test_bf16_allreduce_learns_digits_as_fp32_does(tmp_path):
    common = [
        *job_args(tmp_path, 3),
        "--strategy",
        "allreduce",
        "--precision",
        "bf16",
        "--checkpoint_every",
        "100",
        *DIGITS,
    ]
    procs = {f"worker{r}": start_app(tmp_path, f"worker{r}", ["worker", "--rank", str(r), *common]) for r in (1, 2)}
    wait_for(procs, 180, "the DDP job")
    done = {n: finished(tmp_path, n, p) for n, p in procs.items()}
    for p in done.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr}"
    assert final_accuracy(done["worker1"].stdout) >= 0.90  # the fp32 DDP test's threshold
