"""`python -m app export` (app/export.py): a run's model out for plain PyTorch, loaded back in a
fresh interpreter that reproduces the run's accuracy on its held-out split."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from app import export
from app.checkpoint import export_files
from app.checkpoint import files as checkpoint_files
from app.config import UsageError
from app.data import datasets
from app.training import models

from app_testkit import DIGITS, app_env, final_accuracy, run_app, run_cluster

# A fresh interpreter: the export's builder, its weights and the held-out tensors, nothing else.
# With `project` False it runs where this project's code cannot be imported.
LOAD_AND_SCORE = """
import importlib, json, sys
import torch
card = json.load(open(sys.argv[1] + "/model.json"))
if sys.argv[3:] == ["pt2"]:  # the torch.export program: no builder, no state dict
    model = torch.export.load(sys.argv[1] + "/model.pt2").module()
elif sys.argv[3:] == ["safetensors"]:  # the builder and the weights, without a pickle
    from safetensors.torch import load_file
    module, function = card["builder"].split(":")
    model = getattr(importlib.import_module(module), function)(**card["kwargs"])
    model.load_state_dict(load_file(sys.argv[1] + "/model.safetensors"), strict=True)
    model.eval()
else:
    module, function = card["builder"].split(":")
    model = getattr(importlib.import_module(module), function)(**card["kwargs"])
    model.load_state_dict(torch.load(sys.argv[1] + "/model.pt", weights_only=True), strict=True)
    model.eval()
x, y = torch.load(sys.argv[2], weights_only=True)
size, inp = card["input"], card["input"]
x = x.float() * inp["scale"]
x = (x - torch.tensor(inp["mean"]).view(-1, 1, 1)) / torch.tensor(inp["std"]).view(-1, 1, 1)
if inp.get("step"):
    x = x.expand(-1, 3, -1, -1)
with torch.no_grad():
    right = sum((model(x[i:i + 64]).argmax(1) == y[i:i + 64]).sum().item() for i in range(0, len(y), 64))
print(json.dumps({"accuracy": right / len(y), "app_imported": "app" in sys.modules}))
"""


def _held_out_tensors(path: Path) -> Path:
    """digits' held-out split as the PS evaluates on it, raw (before scale and normalisation)."""
    data = datasets.load("digits", "", "test", seed=1).data
    torch.save((data.x, data.y), path)
    return path


def _score(export_dir: Path, tensors: Path, project: bool, form: str = "pt") -> dict:
    env = app_env() if project else {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    result = subprocess.run(
        [sys.executable, "-c", LOAD_AND_SCORE, str(export_dir), str(tensors), form],
        capture_output=True,
        text=True,
        env=env,
        cwd=export_dir,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _run_and_export(tmp_path: Path, model: str, extra: list[str]) -> tuple[float, Path, dict]:
    args = [*DIGITS, "--run_id", "export-run", *extra]
    args[args.index("--model") + 1] = model
    procs = run_cluster(tmp_path, workers=1, args=args, timeout=240)
    assert all(p.returncode == 0 for p in procs.values()), {n: p.stderr[-600:] for n, p in procs.items()}
    accuracy = final_accuracy(procs["ps"].stdout)
    out = tmp_path / "model"
    dirs = ["--checkpoint_dir", str(tmp_path / "checkpoints"), "--metrics_dir", str(tmp_path / "metrics")]
    result = run_app("export", *args, *dirs, "--export_dir", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    return accuracy, out, json.loads((out / "model.json").read_text())


@pytest.mark.slow
def test_an_exported_cnn_reproduces_the_runs_accuracy_in_a_fresh_interpreter(tmp_path):
    accuracy, out, card = _run_and_export(tmp_path, "cnn", ["--num_epochs", "3"])
    assert card["builder"] == "app.training.models:SmallCNN" and card["kwargs"] == {"channels": 1, "num_classes": 10}
    assert card["run_id"] == "export-run" and card["finished"] is True and card["accuracy"] == accuracy
    assert card["classes"] == [str(i) for i in range(10)] and card["input"]["size"] == [8, 8]
    scored = _score(out, _held_out_tensors(tmp_path / "held_out.pt"), project=True)
    assert scored["accuracy"] == pytest.approx(accuracy, abs=1e-4)


@pytest.mark.slow
def test_an_exported_torchvision_model_loads_without_the_project(tmp_path):
    """resnet18 on one-channel digits: the app wraps it (GrayToRGB); the export is torchvision's
    own model, its keys strict, the wrapper's work an input step."""
    accuracy, out, card = _run_and_export(tmp_path, "resnet18", ["--num_epochs", "1", "--max_steps", "8"])
    assert card["builder"] == "torchvision.models:resnet18" and card["kwargs"] == {"num_classes": 10}
    assert card["input"]["step"] == export_files.GRAY_TO_RGB
    assert card["files"] == ["model.json", "model.pt", "model.pt2", "model.safetensors"]
    assert "not_exported" not in card
    tensors = _held_out_tensors(tmp_path / "held_out.pt")
    for form in ("pt", "pt2", "safetensors"):  # the builder and its state dict; the torch.export program alone
        scored = _score(out, tensors, project=False, form=form)
        assert scored["app_imported"] is False
        assert scored["accuracy"] == pytest.approx(accuracy, abs=1e-4), form


def test_a_model_torch_export_cannot_export_is_named_with_why_and_the_rest_is_written(tmp_path):
    class Branchy(nn.Module):  # data-dependent control flow: torch.export cannot trace it
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if x.sum() > 0 else -self.fc(x)

    from app.checkpoint import export_formats

    program, why = export_formats.program(Branchy(), torch.ones(2, 4))
    assert program is None and why.startswith("torch.export could not export it: ") and "\n" not in why
    written = {"model.pt": b"w", "model.json": json.dumps({"input": {}}).encode()}
    card = json.loads(export_files.with_formats(written, {}, {"model.pt2": why})["model.json"])
    assert card["files"] == ["model.json", "model.pt"] and card["not_exported"] == {"model.pt2": why}


def test_the_gray_to_rgb_wrapper_is_not_in_the_exported_keys():
    built = models.build("resnet18", 1, 10, seed=0)
    assert isinstance(built, nn.Sequential) and isinstance(built[0], models.GrayToRGB)
    weights, step = export_files.unwrapped(built, built.state_dict())
    plain = models.build("resnet18", 3, 10, seed=0)
    assert set(weights) == set(plain.state_dict()) and step == {"step": export_files.GRAY_TO_RGB}
    plain.load_state_dict(weights, strict=True)


def _checkpoint(directory: Path, version: int, run_id: str) -> None:
    model = models.build("cnn", 1, 10, seed=0)
    state = {"version": version, "model": model.state_dict(), "optimizer": {}, "progress": {}, "finished": False}
    checkpoint_files.save({**state, "run_id": run_id, "channels": 1, "num_classes": 10}, directory)


def test_an_unfinished_run_exports_its_newest_checkpoint_and_another_runs_is_found_where_it_was_set_aside(tmp_path):
    _checkpoint(tmp_path, 5, "a")
    _checkpoint(tmp_path, 9, "a")
    path, state = export.find_state(tmp_path, "a")
    assert path.name.startswith("ckpt-") and state["version"] == 9
    checkpoint_files.set_aside(tmp_path, "a")
    _checkpoint(tmp_path, 2, "b")
    assert export.find_state(tmp_path, "a")[1]["version"] == 9  # under previous/a/
    assert export.find_state(tmp_path, "b")[1]["version"] == 2
    with pytest.raises(UsageError, match="no final.pt or checkpoint of run c in .*; earlier runs set aside: a"):
        export.find_state(tmp_path, "c")


def test_export_of_a_directory_with_no_run_exits_2_with_one_line(tmp_path):
    result = run_app(
        "export", *DIGITS, "--run_id", "none", "--checkpoint_dir", str(tmp_path), "--export_dir", str(tmp_path / "m")
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "no final.pt or checkpoint of run none" in result.stderr


def _torn_final(directory: Path, version: int, run_id: str) -> None:
    """final.pt of `run_id` at `version`, cut short as a full disk or a crash leaves it."""
    model = models.build("cnn", 1, 10, seed=0)
    torch.save({"version": version, "model": model.state_dict(), "run_id": run_id}, directory / "final.pt")
    whole = (directory / "final.pt").read_bytes()
    (directory / "final.pt").write_bytes(whole[: len(whole) // 10])


def _ps_records(metrics: Path, run_id: str, *evals: tuple[str, int, float]) -> None:
    metrics.mkdir(parents=True)
    lines = [{"event": "start", "step": 0, "run_id": run_id}]
    lines += [{"event": e, "step": v, "accuracy": a, "metrics": ["accuracy"]} for e, v, a in evals]
    (metrics / "ps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.parametrize("eval_at_160", [True, False], ids=["its_eval", "evaluated_here"])
def test_a_torn_final_pt_exports_the_newest_checkpoint_labelled_with_its_own_version_and_scores(tmp_path, eval_at_160):
    """Before: "run torn has no final.pt (it did not finish)", and version 160 labelled with the
    accuracy of version 176 (the `end` record), which final.pt held and the export did not."""
    checkpoints, metrics, out = tmp_path / "checkpoints", tmp_path / "metrics", tmp_path / "model"
    checkpoints.mkdir()
    _checkpoint(checkpoints, 160, "torn")
    _torn_final(checkpoints, 176, "torn")
    _ps_records(metrics, "torn", ("eval", 160 if eval_at_160 else 150, 0.5), ("end", 176, 0.9))
    dirs = ["--checkpoint_dir", str(checkpoints), "--metrics_dir", str(metrics), "--export_dir", str(out)]
    result = run_app("export", *DIGITS, "--run_id", "torn", *dirs, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "did not finish" not in result.stderr
    assert "run torn has a final.pt that does not load (cut short or damaged" in result.stderr, result.stderr
    card = json.loads((out / "model.json").read_text())
    assert card["version"] == 160 and card["finished"] is False and card["source"].endswith(".pt")
    assert "final.pt" not in card["source"]
    if eval_at_160:
        assert card["accuracy"] == 0.5
    else:  # no record at 160: scored here, as a fresh interpreter scores the exported files
        assert "no evaluation at version 160; evaluated here: Accuracy: " in result.stderr
        scored = _score(out, _held_out_tensors(tmp_path / "held_out.pt"), project=True)
        assert card["accuracy"] == pytest.approx(scored["accuracy"], abs=1e-4) and card["accuracy"] != 0.9
