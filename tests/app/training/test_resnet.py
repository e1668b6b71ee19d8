"""The real workload's code path on CPU: torchvision's ResNet-18 on an ImageFolder
tree in Imagenette's layout (train/ and val/), as `make sample-data` writes it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from app.data import datasets
from app.training import models
from orchestrator import sample_data

from app_testkit import REPO, app_env
from ps_log import last_evaluations

CPU_RESNET = REPO / "configs" / "cpu-resnet.yaml"
# The config as shipped (seed 0, 6 epochs, 2 async workers, plain SGD at lr 0.05),
# which evaluates the model on val/ every 50 updates and at the end. The figure is the
# mean of the last two evaluations (at update 250 and of the final model, ~252): the
# final one alone moves by a few points with the last pushes' order. Measured as
# processes on a 2-core CPU VM (the two; their mean):
#   seed 0: 0.739 0.739 (0.74) | 0.722 0.717 (0.72) | 0.757 0.784 (0.77) | 0.711 0.677 (0.69)
#           0.784 0.780 (0.78)
#   seed 1: 0.682 0.746 (0.71) | seed 2: 0.697 0.690 (0.69) | seed 3: 0.742 0.733 (0.74)
#   loaded CI runs: 0.63 0.588 (0.61) | 0.595 0.541 (0.57), beside the suite's other workers
#   after both cores ran busy loops for its first 10 minutes
# Earlier final figures on the same VM: 0.71, 0.79, 0.73. Momentum 0.5 at lr 0.025 was
# no steadier (finals 0.77, 0.78, 0.64, 0.72, 0.81). The workers' pace, and so the
# staleness of their pushes, follows the host's load: a loaded run learns less in its 6
# epochs. Chance is 0.10; a run that learns much less than the loaded runs fails.
CPU_RESNET_THRESHOLD = 0.45


@pytest.fixture(scope="module")
def sample_tree(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sample") / "tree"
    sample_data.write_tree(out, size=32)
    return out


def test_last_evaluations_reads_the_periodic_ones_then_the_final():
    local = (
        "ps      | ps | Update: 200 | Accuracy: 0.6000\nps      | ps | Update: 250 | Accuracy: 0.7000\n"
        "ps      | Accuracy: 0.6500\nps      | Time: 30.00 seconds\n"
    )
    assert last_evaluations(local) == [0.6, 0.7, 0.65]
    container = (
        "ps | Update: 50 | Accuracy: 0.3000 | step 50 (total unknown), 640 samples/s\n"
        "ps | Update: 100 | Accuracy: 0.5000 | step 100 of 600 (16.7%), 640 samples/s, ETA 0:00:16\n"
        "ps | Update: 150 | Accuracy: 0.6000\nAccuracy: 0.7000\n"
    )
    assert last_evaluations(container) == [0.5, 0.6, 0.7]


def test_torchvision_models_are_available():
    assert "resnet18" in models.available() and "cnn" in models.available()
    model = models.build("resnet18", channels=3, num_classes=10, seed=0)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_sample_tree_has_imagenettes_layout(sample_tree):
    for split, count in (("train", 1348), ("val", 449)):
        classes = sorted(p.name for p in (sample_tree / split).iterdir())
        assert classes == list(sample_data.CLASSES)
        files = list((sample_tree / split).rglob("*.*"))
        assert len(files) == count
        assert {f.suffix for f in files} == {".JPEG", ".png"}


def test_sample_tree_is_the_same_every_time(tmp_path, sample_tree):
    sample_data.write_tree(tmp_path / "again", size=32)
    some = sorted((sample_tree / "val" / "digit_3").iterdir())[:5]
    for path in some:
        assert (tmp_path / "again" / "val" / "digit_3" / path.name).read_bytes() == path.read_bytes()


def test_imagefolder_with_train_and_val_evaluates_on_val(sample_tree):
    train = datasets.load("imagefolder", str(sample_tree), "train", seed=0, image_size=32)
    held_out = datasets.load("imagefolder", str(sample_tree), "test", seed=0, image_size=32)
    assert (len(train.data), len(held_out.data)) == (1348, 449)
    assert (train.channels, train.num_classes) == (3, 10)
    x, y = held_out.data[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= y < 10


def test_image_size_sets_the_crop(sample_tree):
    small = datasets.load("imagefolder", str(sample_tree), "train", seed=0, image_size=24)
    assert small.data[0][0].shape == (3, 24, 24)


def test_train_and_val_with_different_classes_is_an_error(tmp_path, sample_tree):
    import shutil

    shutil.copytree(sample_tree, tmp_path / "tree")
    shutil.rmtree(tmp_path / "tree" / "val" / "digit_9")
    with pytest.raises(datasets.UsageError, match="same class folders"):
        datasets.load("imagefolder", str(tmp_path / "tree"), "test", seed=0)


@pytest.mark.slow
def test_cpu_resnet_trains_as_local_processes(tmp_path, sample_tree):
    """`make local CONFIG=configs/cpu-resnet.yaml WORKERS=2`, on the sample tree."""
    topology = yaml.safe_load(CPU_RESNET.read_text())
    topology["train"]["data_dir"] = str(sample_tree)
    config = tmp_path / "cpu-resnet.yaml"
    config.write_text(yaml.safe_dump(topology))
    r = subprocess.run(
        [sys.executable, "-m", "orchestrator", "local", "-c", str(config), "--workers", "2"],
        cwd=tmp_path,
        env=app_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert re.search(r"^worker2 +\| worker2 \| Epoch: 6 \| Batch: \d+ \| Loss: ", r.stdout, re.MULTILINE), r.stdout[
        -2000:
    ]
    ps_log = "\n".join(line for line in r.stdout.splitlines() if re.match(r"ps +\| ", line))
    final = float(re.search(r"^ps +\| Accuracy: ([0-9.]+)$", ps_log, re.MULTILINE).group(1))
    last = last_evaluations(ps_log, 2)
    print(f"cpu-resnet as processes: last two evaluations {last}, final {final:.4f}")
    assert len(last) == 2 and last[-1] == final, ps_log[-3000:]
    assert sum(last) / 2 >= CPU_RESNET_THRESHOLD, ps_log[-3000:]
    assert (tmp_path / "runs" / "cpu-resnet" / "checkpoints" / "final.pt").is_file()
