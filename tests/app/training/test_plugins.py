"""The user's own model and dataset (`package.module:factory`) and --init_weights, as real processes."""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from app import plugins
from app.config import UsageError
from app.training import models

from app_testkit import REPO, app_env, digits, free_port, run_app, run_cluster, start_app, wait_for

EXAMPLE = REPO / "examples" / "custom"
EXAMPLE_ARGS = [
    "--model",
    "mynet.model:build",
    "--dataset",
    "mynet.data:digits_npz",
    "--data_dir",
    str(EXAMPLE / "data"),
    "--batch_size",
    "32",
    "--lr",
    "0.1",
    "--num_epochs",
    "15",
    "--eval_every",
    "100",
    "--rpc_timeout",
    "30",
    "--seed",
    "1",
]
# Measured as PS + 2 workers on a 2-core CPU VM: 0.928-0.953 over seeds 0-3.
EXAMPLE_ACCURACY = 0.85
DIGITS = digits(rpc_timeout=30)


def _env_with(*paths: Path) -> dict[str, str]:
    env = app_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *map(str, paths)])
    return env


def _not_logs(stderr: str) -> list[str]:
    """stderr without the app's timestamped log lines (INFO before the error)."""
    return [line for line in stderr.splitlines() if not re.match(r"^\d{4}-\d\d-\d\d ", line)]


def _final_accuracy(ps_stdout: str) -> float:
    lines = [line for line in ps_stdout.splitlines() if line.startswith("Accuracy: ")]
    assert len(lines) == 1, ps_stdout
    return float(lines[0].split()[1])


def _code(tmp_path: Path, source: str) -> Path:
    """A `code` directory holding package `mymods` with module `net` = `source`."""
    pkg = tmp_path / "code" / "mymods"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(textwrap.dedent(source))
    return tmp_path / "code"


GOOD = """
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    def build(num_classes, channels):
        return nn.Sequential(nn.Flatten(), nn.Linear(channels * 64, num_classes))

    def data(root, train, seed):
        return TensorDataset(torch.zeros(8, 1, 8, 8), torch.zeros(8, dtype=torch.long)), 1, 10

    not_callable = 3

    def not_a_module(num_classes, channels):
        return "a string"

    def two_things(root, train, seed):
        return TensorDataset(torch.zeros(8, 1)), 1

    def a_list(root, train, seed):
        return [1, 2, 3], 1, 10

    def float_channels(root, train, seed):
        return TensorDataset(torch.zeros(8, 1, 8, 8), torch.zeros(8)), 1.0, 10

    def raises(num_classes, channels):
        raise ValueError("no such layer size")

    def complex_weights(num_classes, channels):
        model = nn.Linear(channels * 64, num_classes)
        model.weight = nn.Parameter(torch.zeros(num_classes, channels * 64, dtype=torch.cfloat))
        return model

    CALLS = []

    def second_call_raises(model, batches, loss):
        CALLS.append(1)
        if len(CALLS) == 2:
            raise RuntimeError("the metric broke at its second call")
        correct = total = 0
        for x, y in batches:
            correct += int((model(x).argmax(-1) == y).sum())
            total += y.numel()
        return {"accuracy": correct / max(1, total)}

    def always_raises(model, batches, loss):
        raise KeyError("bleu")

    class Strict(nn.Module):
        def __init__(self, num_classes, channels):
            super().__init__()
            self.linear = nn.Linear(channels * 64, num_classes)

        def forward(self, x, lengths):
            return self.linear(x.flatten(1))

    def strict(num_classes, channels):
        return Strict(num_classes, channels)

    def vocabulary_per_split(root, train, seed):  # each split builds its own "vocabulary"
        g = torch.Generator().manual_seed(0 if train else 1)
        classes = 10 if train else 12
        x, y = torch.rand(64, 1, 8, 8, generator=g), torch.randint(classes, (64,), generator=g)
        return TensorDataset(x, y), 1, classes

    def lbfgs(param_groups, lr):
        return torch.optim.LBFGS([p for g in param_groups for p in g["params"]], lr=lr)
"""


# A broken `--model` or `--dataset` entry point: (model, dataset, the error's one line).
BROKEN = [
    (
        "nosuch.net:build",
        "digits",
        "--model nosuch.net:build: cannot import 'nosuch.net': No module named 'nosuch' "
        "(is the topology's `code` directory the one that holds it?)",
    ),
    ("mymods.net:missing", "digits", "--model mymods.net:missing: module 'mymods.net' has no attribute 'missing'"),
    (
        "mymods.net:not_callable",
        "digits",
        "--model mymods.net:not_callable: 'not_callable' is a int, not a callable",
    ),
    (
        "mymods.net:not_a_module",
        "digits",
        "--model mymods.net:not_a_module: returned a str; must return a torch.nn.Module",
    ),
    ("mymods.net:raises", "digits", "--model mymods.net:raises: calling it failed: ValueError: no such layer size"),
    (
        "mymods.net:complex_weights",
        "digits",
        "--model mymods.net:complex_weights: parameter weight is complex (1 in all); the PS holds real parameters",
    ),
    (
        "cnn",
        "mymods.net:two_things",
        "--dataset mymods.net:two_things: returned a tuple of 2; must return (Dataset, channels, num_classes)",
    ),
    (
        "cnn",
        "mymods.net:a_list",
        "--dataset mymods.net:a_list: returned a list as the dataset; must be a torch.utils.data.Dataset",
    ),
    (
        "cnn",
        "mymods.net:float_channels",
        "--dataset mymods.net:float_channels: returned channels 1.0; must be an int >= 1",
    ),
]
BROKEN_IDS = [
    "import",
    "attribute",
    "not-callable",
    "not-a-module",
    "factory-raises",
    "complex-parameter",
    "tuple-shape",
    "not-a-dataset",
    "float-channels",
]


@pytest.fixture
def mymods(tmp_path, monkeypatch):
    """GOOD's package `mymods` on sys.path, imported afresh by this test and forgotten after it."""
    code = _code(tmp_path, GOOD)
    monkeypatch.syspath_prepend(str(code))
    for name in ("mymods", "mymods.net"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield code
    for name in ("mymods", "mymods.net"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("model, dataset, expected", BROKEN, ids=BROKEN_IDS)
def test_a_broken_entry_point_is_a_usage_error_naming_the_flag_and_why(mymods, model, dataset, expected):
    """What the process prints after `app: error: ` (below), for each way an entry point breaks."""
    with pytest.raises(UsageError) as error:
        if plugins.is_entry_point(model):
            plugins.build_model(model, 1, 10)
        else:
            plugins.load_dataset(dataset, "", True, 0)
    assert str(error.value).startswith(expected)


def test_an_optimizer_whose_step_needs_a_closure_is_refused_by_name(mymods):
    from app.recipes import Optimizer
    from app.training import optimizers

    recipe = Optimizer("mymods.net:lbfgs", {"lr": 0.1}, True)
    with pytest.raises(
        UsageError, match=r"^--optimizer mymods.net:lbfgs: returned a LBFGS, whose step needs a closure"
    ):
        optimizers.make(recipe, [{"params": [torch.zeros(2, requires_grad=True)]}])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["import", "not-a-dataset"])  # one of each flag; the rest above
def test_a_worker_given_a_broken_entry_point_exits_2_with_its_one_line(tmp_path, case):
    model, dataset, expected = BROKEN[BROKEN_IDS.index(case)]
    code = _code(tmp_path, GOOD)
    r = run_app(
        "worker",
        "--model",
        model,
        "--dataset",
        dataset,
        "--world_size",
        "2",
        "--rank",
        "1",
        "--master_port",
        "1",
        env=_env_with(code),
    )
    assert r.returncode == 2, r.stderr
    assert _not_logs(r.stderr) == [f"app: error: {expected}"]


# A plug-in that fails on the PS's first held-out batch: (flags, the one error line).
PREFLIGHT = [
    (
        ["--model", "mymods.net:strict"],
        "--model mymods.net:strict: its forward on a held-out batch failed: TypeError: "
        "Strict.forward() missing 1 required positional argument: 'lengths'",
    ),
    (
        ["--model", "mymods.net:build", "--loss", "mse"],
        "--loss mse: on a held-out batch (outputs [",
    ),
    (["--metrics", "mymods.net:always_raises"], "--metrics mymods.net:always_raises: KeyError: 'bleu'"),
]


@pytest.mark.slow
@pytest.mark.parametrize("flags, expected", PREFLIGHT, ids=["model-typeerror", "loss-shapes", "metric-raises"])
def test_a_plug_in_that_fails_on_one_batch_stops_the_ps_before_any_worker_trains(tmp_path, flags, expected):
    code = _code(tmp_path, GOOD)
    r = run_app("ps", *DIGITS, *flags, "--world_size", "2", "--master_port", str(free_port()), env=_env_with(code))
    assert r.returncode == 2, r.stderr
    lines = _not_logs(r.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"app: error: {expected}"), r.stderr


@pytest.mark.slow
def test_splits_that_disagree_on_num_classes_stop_the_job_once_with_one_line(tmp_path):
    code = _code(tmp_path, GOOD)
    args = ["--model", "mymods.net:build", "--dataset", "mymods.net:vocabulary_per_split", "--rpc_timeout", "30"]
    started = time.monotonic()
    procs = run_cluster(tmp_path, workers=2, args=args, timeout=60, env=_env_with(code))
    line = (
        "app: error: the training split gives num_classes 10; the held-out split the PS built its model from "
        "gives num_classes 12: both splits must agree"
    )
    for name in ("worker1", "worker2"):
        said = _not_logs(procs[name].stderr)
        assert procs[name].returncode == 2 and len(said) == 1 and said[0].startswith(line), procs[name].stderr
    ps = _not_logs(procs["ps"].stderr)
    assert procs["ps"].returncode == 2 and len(ps) == 1 and ps[0].startswith(line), procs["ps"].stderr
    assert ps[0].endswith("(found by a worker as it joined)")
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_the_held_out_evaluation_takes_eval_batch_size_batches(tmp_path):
    r = run_app("ps", *DIGITS, "--loss", "mse", "--eval_batch_size", "50", "--master_port", str(free_port()))
    assert r.returncode == 2 and "--loss mse: on a held-out batch (outputs [50, 10], targets [50])" in r.stderr


@pytest.mark.slow
def test_a_metric_that_raises_during_the_run_is_said_once_and_training_goes_on(tmp_path):
    code = _code(tmp_path, GOOD)
    args = [*DIGITS, "--num_epochs", "2", "--eval_every", "10", "--metrics", "mymods.net:second_call_raises"]
    procs = run_cluster(tmp_path, workers=1, args=args, timeout=180, env=_env_with(code))
    ps = procs["ps"]
    assert all(p.returncode == 0 for p in procs.values()), ps.stderr
    said = [line for line in ps.stderr.splitlines() if "the metric broke" in line]
    assert len(said) == 1 and "evaluation at update 10 failed, training goes on without it" in said[0]
    assert (tmp_path / "checkpoints" / "final.pt").exists()
    assert _final_accuracy(ps.stdout) > 0.5  # the later evaluations, the final one among them


@pytest.mark.slow
def test_a_module_that_fails_to_import_names_the_error(tmp_path):
    code = _code(tmp_path, "x = 1 / 0\n")
    r = run_app("ps", "--model", "mymods.net:build", "--dataset", "digits", env=_env_with(code))
    assert r.returncode == 2, r.stderr
    assert _not_logs(r.stderr) == [
        "app: error: --model mymods.net:build: importing 'mymods.net' failed: ZeroDivisionError: division by zero"
    ]


def test_a_dataset_that_is_neither_built_in_nor_an_entry_point_is_a_usage_error():
    r = run_app("ps", "--dataset", "my.mod.data")
    assert r.returncode == 2
    assert _not_logs(r.stderr) == [
        "app: error: --dataset: 'my.mod.data' is not one of imagefolder, mnist, "
        "cifar10, digits, synthetic, stdlib_text, webdataset, nor an entry point package.module:factory"
    ]


@pytest.mark.slow
def test_the_custom_example_trains_as_ps_and_two_workers(tmp_path):
    procs = run_cluster(tmp_path, workers=2, args=EXAMPLE_ARGS, timeout=180, env=_env_with(EXAMPLE))

    for p in procs.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr}"
    assert _final_accuracy(procs["ps"].stdout) >= EXAMPLE_ACCURACY
    final = torch.load(tmp_path / "checkpoints" / "final.pt")
    assert set(final["model"]) == {
        "features.0.weight",
        "features.0.bias",
        "features.2.weight",
        "features.2.bias",
        "head.weight",
        "head.bias",
    }
    assert "1438 samples, 1 channel(s), 10 classes" in procs["worker1"].stderr


# --- --init_weights ------------------------------------------------------------------


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
def test_the_ps_starts_from_init_weights_and_allreduce_from_a_final_pt(tmp_path):
    # Weights no seed of the run would give: the `cnn` built with seed 123, then scaled.
    start = {k: v * 0.5 for k, v in models.build("cnn", 1, 10, seed=123).state_dict().items()}
    weights = tmp_path / "start.pt"
    torch.save(start, weights)
    fresh = models.build("cnn", 1, 10, seed=0).state_dict()
    assert _max_diff(start, fresh) > 0.05  # so "close to start" below means loaded, not a coincidence

    # One push per worker at a tiny lr: the model the PS ends with is the one it started from.
    args = [*DIGITS, "--lr", "1e-6", "--max_steps", "1", "--seed", "0", "--init_weights", str(weights)]
    ps_run = tmp_path / "ps-run"
    ps_run.mkdir()
    procs = run_cluster(ps_run, workers=2, args=args, timeout=120)
    assert {p.name: p.returncode for p in procs.values()} == {"ps": 0, "worker1": 0, "worker2": 0}, procs["ps"].stderr
    final = tmp_path / "ps-run" / "checkpoints" / "final.pt"
    assert _max_diff(torch.load(final)["model"], start) < 1e-3

    # The PS's final.pt (state dict under "model") as the start of an allreduce job: every rank.
    args = [
        *DIGITS,
        "--lr",
        "1e-6",
        "--max_steps",
        "1",
        "--seed",
        "0",
        "--strategy",
        "allreduce",
        "--init_weights",
        str(final),
    ]
    ddp_run = tmp_path / "ddp-run"
    ddp_run.mkdir()
    common = [
        "--world_size",
        "3",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "--metrics_dir",
        str(ddp_run / "metrics"),
        "--checkpoint_dir",
        str(ddp_run / "checkpoints"),
        *args,
    ]
    ranks = {f"worker{r}": start_app(ddp_run, f"worker{r}", ["worker", "--rank", str(r), *common]) for r in (1, 2)}
    wait_for(ranks, 120, "the DDP job")
    assert {n: p.returncode for n, p in ranks.items()} == {"worker1": 0, "worker2": 0}, (
        ddp_run / "worker1.err"
    ).read_text()
    assert _max_diff(torch.load(ddp_run / "checkpoints" / "final.pt")["model"], start) < 1e-3


@pytest.mark.slow
def test_every_ps_shard_starts_from_its_slice_of_init_weights(tmp_path):
    start = {k: v * 0.5 for k, v in models.build("cnn", 1, 10, seed=123).state_dict().items()}
    weights = tmp_path / "start.pt"
    torch.save(start, weights)
    args = [*DIGITS, "--lr", "1e-6", "--max_steps", "1", "--seed", "0", "--init_weights", str(weights), "--shards", "2"]
    procs = run_cluster(tmp_path, workers=1, args=args, timeout=120, shards=2)
    assert {p.name: p.returncode for p in procs.values()} == {"ps": 0, "ps1": 0, "worker1": 0}, procs["ps"].stderr
    # final.pt is gathered from both shards: both slices must be the file's values.
    assert _max_diff(torch.load(tmp_path / "checkpoints" / "final.pt")["model"], start) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, expected",
    [
        ("shape", "key 'classifier.3.weight' has shape [7, 128] in the file, [10, 128] in the model"),
        ("missing", "key 'classifier.3.bias' (shape [10] in the model) is missing from the file"),
        ("unexpected", "key 'extra.weight' (shape [2, 2] in the file) is not in the model (1 unexpected key(s))"),
    ],
)
def test_init_weights_that_do_not_fit_name_the_first_bad_key(tmp_path, change, expected):
    state = models.build("cnn", 1, 10, seed=0).state_dict()
    if change == "shape":
        state["classifier.3.weight"] = torch.zeros(7, 128)
    elif change == "missing":
        del state["classifier.3.bias"]
    else:
        state["extra.weight"] = torch.zeros(2, 2)
    path = tmp_path / "w.pt"
    torch.save(state, path)
    r = run_app(
        "ps",
        *DIGITS,
        "--lr",
        "0.1",
        "--init_weights",
        str(path),
        "--metrics_dir",
        str(tmp_path / "m"),
        "--checkpoint_dir",
        str(tmp_path / "c"),
    )
    assert r.returncode == 2, r.stderr
    assert _not_logs(r.stderr) == [f"app: error: --init_weights {path}: {expected}"]


@pytest.mark.slow
def test_init_weights_that_are_not_a_state_dict_are_a_usage_error(tmp_path):
    path = tmp_path / "w.pt"
    path.write_bytes(b"not a torch file")
    r = run_app("ps", *DIGITS, "--lr", "0.1", "--init_weights", str(path))
    assert r.returncode == 2, r.stderr
    lines = _not_logs(r.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"app: error: --init_weights {path}: not a readable state dict"), (
        lines
    )
