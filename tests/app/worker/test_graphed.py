"""`--cuda_graphs` / `train.cuda_graphs` (app.worker.graphed): what cannot be captured is refused
at config time, a CPU worker runs its step eagerly and says so, and on a GPU the replayed step's
gradient is the eager step's (those tests need a CUDA GPU: skipped elsewhere)."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml
from torch import nn

from app.config import UsageError, parse
from app.exchange.route import Pusher
from app.exchange.socket_route import SocketRoute
from app.runtime import devices
from app.training import losses, models
from app.training.flat import FlatModel
from app.worker.graphed import GraphedStep
from app.worker.trainer import Trainer
from orchestrator.topology.model import TopologyError
from orchestrator.topology.model import parse as parse_topology

import needs
from app_testkit import DIGITS, REPO, final_accuracy, recording_channel, run_cluster, started


def test_cuda_graphs_is_off_by_default_and_refused_with_fp16_or_allreduce():
    assert parse(["worker"], {}).cuda_graphs is False
    assert parse(["worker", "--cuda_graphs", "true", "--device", "cuda"], {}).cuda_graphs is True
    with pytest.raises(UsageError, match="^--cuda_graphs: got true; not with precision fp16 .*host decisions"):
        parse(["worker", "--cuda_graphs", "true", "--precision", "fp16", "--device", "cuda"], {})
    with pytest.raises(UsageError, match="^--cuda_graphs: got true; allowed only with a parameter server"):
        parse(["worker", "--cuda_graphs", "true", "--strategy", "allreduce"], {})
    with pytest.raises(UsageError, match="^PSC_CUDA_GRAPHS: got true; allowed only with a parameter server"):
        parse(["worker", "--strategy", "allreduce"], {"PSC_CUDA_GRAPHS": "true"})


def test_the_topology_refuses_cuda_graphs_under_allreduce():
    doc = yaml.safe_load((REPO / "configs/cpu-smoke.yaml").read_text())
    doc["train"].update(cuda_graphs=True, strategy="allreduce")
    with pytest.raises(TopologyError, match="train.cuda_graphs: got True; allowed only with a parameter server"):
        parse_topology(yaml.safe_dump(doc), "t.yaml")


def test_a_cpu_worker_runs_its_step_eagerly_and_says_so_once(caplog):
    config = parse(["worker", "--cuda_graphs", "true"], {})
    model = models.build("cnn", 1, 10, seed=0)
    with caplog.at_level(logging.INFO, logger="app.worker"):
        trainer = Trainer(config, model, None, None, torch.device("cpu"), recording_channel(), None)
    said = [r.getMessage() for r in caplog.records if "cuda_graphs" in r.getMessage()]
    assert said == ["worker1: --cuda_graphs needs device cuda; the step runs eagerly on cpu"]
    assert trainer.graphed is None
    started(trainer)
    loss = trainer.compute_gradients(torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3]))
    assert float(loss) > 0 and trainer.flat.grads.abs().sum() > 0


@pytest.mark.slow
def test_a_cpu_cluster_with_cuda_graphs_learns_digits_eagerly(tmp_path):
    procs = run_cluster(tmp_path, workers=1, args=DIGITS + ["--cuda_graphs", "true"], timeout=180)
    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr}"
    assert final_accuracy(procs["ps"].stdout) >= 0.90  # the fp32 cluster test's threshold
    worker = procs["worker1"]
    assert (worker.stdout + worker.stderr).count("--cuda_graphs needs device cuda; the step runs eagerly") == 1


# --- on a GPU ---------------------------------------------------------------------------------

CUDA = torch.device("cuda")


def cnn_on_gpu() -> tuple[nn.Module, FlatModel]:
    model = models.build("cnn", 1, 10, seed=0).to(CUDA)
    return model, FlatModel(model, own_buffers=True)


def eager(model: nn.Module, flat: FlatModel, x: torch.Tensor, y: torch.Tensor, precision: str) -> torch.Tensor:
    loss_fn = losses.build({"name": "cross_entropy"})
    with flat.writing_grads():
        with devices.autocast(precision, CUDA):
            loss = loss_fn(model(x), y)
        loss.backward()
    return loss.detach()


def batch(seed: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g).to(CUDA), torch.randint(0, 10, (n,), generator=g).to(CUDA)


@needs.cuda_gpu()
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_replayed_step_gives_the_eager_steps_gradient_and_buffers(precision):
    model, flat = cnn_on_gpu()
    twin, twin_flat = cnn_on_gpu()  # the same seed: the same state
    step = GraphedStep(model, flat, losses.build({"name": "cross_entropy"}), precision, CUDA, "cnn", batch_size=16)
    tol = {"atol": 1e-5, "rtol": 1e-4} if precision == "fp32" else {"atol": 1e-2, "rtol": 1e-2}
    for seed in (1, 2, 3):  # the capture's step, then two replays of other batches
        x, y = batch(seed)
        assert step.fits(x, y)
        loss = step.step(x, y)
        want = eager(twin, twin_flat, x, y, precision)
        torch.testing.assert_close(loss, want, **tol)
        torch.testing.assert_close(flat.grads, twin_flat.grads, **tol)
        torch.testing.assert_close(flat.buffers, twin_flat.buffers, **tol)  # the warm-up left none behind
    assert step.replays == 3
    message = flat.message.untyped_storage().data_ptr()
    assert all(p.grad is not None and p.grad.untyped_storage().data_ptr() == message for p in model.parameters())
    assert not step.fits(*batch(4, n=5))  # a partial batch runs eagerly


@needs.cuda_gpu()
def test_a_gpu_trainer_replays_its_step_and_takes_the_reply_whole():
    config = parse(["worker", "--cuda_graphs", "true", "--device", "cuda", "--batch_size", "16"], {})
    model = models.build("cnn", 1, 10, seed=0).to(CUDA)
    channel = recording_channel()
    channel.real = SocketRoute(Pusher(1, "worker1", device=CUDA))
    trainer = Trainer(config, model, None, None, CUDA, channel, None)
    assert trainer.graphed is not None
    started(trainer)
    twin, twin_flat = cnn_on_gpu()
    for seed in (1, 2):
        x, y = batch(seed)
        trainer.compute_gradients(x, y)
        eager(twin, twin_flat, x, y, "fp32")
        torch.testing.assert_close(trainer.flat.grads, twin_flat.grads, atol=1e-5, rtol=1e-4)
    assert trainer.graphed.replays == 2
    x, y = batch(5, n=5)  # a last, partial batch: eager
    trainer.compute_gradients(x, y)
    eager(twin, twin_flat, x, y, "fp32")
    torch.testing.assert_close(trainer.flat.grads, twin_flat.grads, atol=1e-5, rtol=1e-4)
    assert trainer.graphed.replays == 2


class HostDecides(nn.Module):
    """A model whose forward asks the host about the data: it cannot be captured."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x.flatten(1))
        return out if bool(out.sum() > 0) else -out


@needs.cuda_gpu()
def test_a_model_that_cannot_be_captured_is_one_line_naming_it():
    model = HostDecides().to(CUDA)
    flat = FlatModel(model, own_buffers=True)
    step = GraphedStep(model, flat, losses.build({"name": "cross_entropy"}), "fp32", CUDA, "mine:host", 16)
    with pytest.raises(UsageError) as error:
        step.step(*batch(1))
    said = str(error.value)
    assert said.startswith("--cuda_graphs: model mine:host cannot be captured as a CUDA graph: ") and "\n" not in said
