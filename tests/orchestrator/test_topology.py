"""Bad input: exit 2, one line on stderr naming the field, no file left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.topology.model import TopologyError, load, parse

from orch_helpers import REPO, topology

# (id, topology file content (dict or raw text), extra CLI args, text the one error line must contain)
BAD = [
    ("not-yaml", "name: [unclosed\n", [], "not valid YAML: line"),
    ("not-a-mapping", "- a\n- b\n", [], "must be a mapping"),
    ("empty-file", "", [], "got an empty file"),
    ("duplicate-key", "name: a\nname: b\n", [], "duplicate key 'name'"),
    ("unknown-top-key", topology(bogus=1), [], "bogus: unknown key; allowed: name, image"),
    (
        "unknown-nested-key",
        topology(train={"epoch": 3}),
        [],
        "train.epoch: unknown key; did you mean epochs? allowed: model,",
    ),
    ("section-not-mapping", topology(train=5), [], "train: got 5; must be a mapping"),
    ("missing-key", {k: v for k, v in topology().items() if k != "train"}, [], "train: missing"),
    ("missing-nested-key", topology(image={"base": "x"}) | {"image": {"base": "x"}}, [], "image.device: missing"),
    (
        "wrong-type-str-for-int",
        topology(train={"batch_size": "big"}),
        [],
        "train.batch_size: got 'big'; must be a valid integer",
    ),
    ("wrong-type-bool-for-int", topology(workers={"count": True}), [], "workers.count: got True"),
    ("wrong-type-float-for-int", topology(train={"epochs": 1.5}), [], "train.epochs: got 1.5"),
    ("bad-device", topology(image={"device": "tpu"}), [], "image.device: got 'tpu'; must be 'cuda' or 'cpu'"),
    ("bad-dataset", topology(train={"dataset": "imagenet"}), [], "train.dataset: got 'imagenet'"),
    ("count-zero", topology(workers={"count": 0}), [], "workers.count: got 0; must be greater than 0"),
    (
        "max-below-count",
        topology(workers={"count": 3, "max": 2}),
        [],
        "workers.max: got 2; must be at least the number of workers (3), or left out",
    ),
    ("max-below-workers", topology(workers={"count": 2, "max": 3}), ["--workers", "4"], "workers.max: got 3;"),
    (
        "max-allreduce",
        topology(workers={"count": 2, "max": 4}, train={"strategy": "allreduce"}),
        [],
        "workers.max: got 4; strategy allreduce has a fixed world size",
    ),
    ("batch-negative", topology(train={"batch_size": -1}), [], "train.batch_size: got -1"),
    ("lr-zero", topology(train={"lr": 0}), [], "train.lr: got 0; must be greater than 0"),
    ("momentum-one", topology(train={"momentum": 1}), [], "train.momentum: got 1"),
    ("shm-zero", topology(ps={"shm_size": 0}), [], "ps.shm_size: got 0; must be a positive size"),
    ("shm-words", topology(workers={"shm_size": "lots"}), [], "workers.shm_size: got 'lots'"),
    ("rpc-port-low", topology(ps={"rpc_port": 80}), [], "ps.rpc_port: got 80"),
    ("gpu-negative", topology(workers={"gpus": [0, -1]}), [], "workers.gpus[1]: got -1"),
    (
        "duplicate-gpus",
        topology(image={"device": "cuda"}, workers={"count": 2, "gpus": [1, 1]}),
        [],
        "workers.gpus: got [1, 1]; GPU ids must be distinct",
    ),
    (
        "more-workers-than-gpus",
        topology(image={"device": "cuda"}, workers={"count": 3, "gpus": [0, 1]}),
        [],
        "workers.gpus: got [0, 1] for 3 workers; must list one GPU id per worker",
    ),
    (
        "override-more-than-gpus",
        topology(image={"device": "cuda"}, workers={"count": 2, "gpus": [0, 1]}),
        ["--workers", "3"],
        "with --workers 3: workers.gpus: got [0, 1] for 3 workers",
    ),
    (
        "data-dir-missing-key",
        topology(train={"dataset": "imagefolder"}),
        [],
        "train.data_dir: missing; required for dataset 'imagefolder'",
    ),
    ("bad-name", topology(name="My Run"), [], "name: got 'My Run'; must be lowercase"),
    ("bad-tag", topology(image={"tag": "Ps Compose"}), [], "image.tag: got 'Ps Compose'"),
    ("bad-ifname", topology(network={"ifname": "eth 0"}), [], "network.ifname: got 'eth 0'"),
    (
        "loader-workers-negative",
        topology(train={"loader_workers": -1}),
        [],
        "train.loader_workers: got -1; must be auto or a whole number >= 0",
    ),
    (
        "loader-workers-word",
        topology(train={"loader_workers": "many"}),
        [],
        "train.loader_workers: got 'many'; must be auto or a whole number >= 0",
    ),
    (
        "image-cache-bad",
        topology(train={"image_cache": "disk"}),
        [],
        "train.image_cache: got 'disk'; must be 'auto', 'off', 'memory' or 'file'",
    ),
    (
        "tracking-mlflow-string",
        topology(tracking={"mlflow": "yes"}),
        [],
        "tracking.mlflow: got 'yes'; must be a valid boolean",
    ),
    ("tracking-unknown-key", topology(tracking={"server": True}), [], "tracking.server: unknown key; allowed: mlflow"),
    (
        "tracking-mlflow-without-a-ps",
        topology(tracking={"mlflow": True}, train={"strategy": "allreduce"}),
        [],
        "tracking.mlflow: got true; the PS logs the run to MLflow, and strategy allreduce has none: "
        "allowed only with a strategy that has a PS (async, ssp, sync)",
    ),
    ("workers-zero-flag", topology(), ["--workers", "0"], "--workers: got 0; must be at least 1"),
    ("workers-not-number", topology(), ["--workers", "two"], "--workers: got 'two'"),
]


@pytest.mark.parametrize("content,extra,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
@pytest.mark.parametrize("existing", [False, True], ids=["new-output", "existing-output"])
def test_bad_input(cli, write_config, tmp_path: Path, content, extra, expected, existing: bool) -> None:
    config = write_config(content)
    out = tmp_path / "out" / "compose.yaml"
    out.parent.mkdir()
    if existing:
        out.write_text("old\n")
    status, stdout, stderr = cli("render", "-c", str(config), *extra, "-o", str(out))
    assert status == 2
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert stdout == ""
    assert sorted(p.name for p in out.parent.iterdir()) == (["compose.yaml"] if existing else [])
    if existing:
        assert out.read_text() == "old\n"


def test_missing_file(cli, tmp_path: Path) -> None:
    status, stdout, stderr = cli("render", "-c", "nope.yaml", "-o", "out.yaml")
    assert (status, stdout, stderr) == (2, "", "error: nope.yaml: no such file\n")
    assert list(tmp_path.iterdir()) == []


def test_config_missing_in_cwd_and_in_the_project(cli, tmp_path: Path) -> None:
    status, _, stderr = cli("render", "-c", "nothing.yaml")
    assert status == 2 and stderr == "error: nothing.yaml: no such file\n"


def test_default_config_missing_in_cwd_is_the_projects_own(cli, tmp_path: Path) -> None:
    status, out, _ = cli("render", "-o", "-")  # configs/default.yaml, installed with the package
    assert status == 0 and "services:" in out
    assert not list(tmp_path.iterdir())


def test_unwritable_output(cli, write_config) -> None:
    config = write_config(topology())
    status, _, stderr = cli("render", "-c", str(config), "-o", "no/such/dir/compose.yaml")
    assert status == 2 and len(stderr.splitlines()) == 1 and "-o no/such/dir/compose.yaml" in stderr


def test_usage_errors_are_one_line(cli) -> None:
    for args in ([], ["bogus"], ["render", "--nope"], ["render", "-c"]):
        status, _, stderr = cli(*args)
        assert status == 2 and len(stderr.splitlines()) == 1, (args, stderr)


def test_error_carries_the_path() -> None:
    with pytest.raises(TopologyError) as e:
        parse(
            "name: t\nimage: {base: b, device: cpu}\n"
            "train: {model: cnn, dataset: digits, batch_size: 1, lr: 1, epochs: 1}\n"
            "workers: {count: 1, shm_size: -5}\n",
            "x.yaml",
        )
    assert e.value.path == "workers.shm_size"
    assert str(e.value).startswith("x.yaml: workers.shm_size: got -5;")


def test_shipped_configs_load() -> None:
    d = load(REPO / "configs/default.yaml")
    assert (d.train.model, d.train.dataset, d.train.batch_size, d.train.lr, d.train.epochs) == (
        "resnet18",
        "imagefolder",
        256,
        0.1,
        150,
    )
    assert d.train.optimizer == {"name": "sgd", "momentum": 0.9, "weight_decay": 1e-4}  # torchvision's recipe
    assert d.train.schedule["name"] == "step"
    assert d.cuda and d.workers.count == 3 and d.worker_gpus() == [0, 1, 2]
    s = load(REPO / "configs/cpu-smoke.yaml")
    assert not s.cuda and s.train.model == "cnn" and s.train.dataset == "digits" and s.workers.count == 2
    assert s.worker_gpus() == [] and not s.reads_files
    lm = load(REPO / "configs/cpu-lm.yaml")
    assert (lm.train.model, lm.train.dataset, lm.train.metrics) == ("char_transformer", "stdlib_text", "perplexity")
    assert lm.train.optimizer["name"] == "adamw" and lm.train.clip_grad_norm == 1.0 and not lm.reads_files


def test_workers_override_defaults_gpus() -> None:
    t = parse(_yaml(topology(image={"device": "cuda"}, workers={"count": 2})))
    assert t.worker_gpus() == [0, 1]
    assert t.with_workers(5).worker_gpus() == [0, 1, 2, 3, 4]
    assert t.with_workers(5).world_size == 6


def test_workers_override_uses_listed_gpus() -> None:
    t = parse(_yaml(topology(image={"device": "cuda"}, workers={"count": 1, "gpus": [3, 5, 7]})))
    assert t.worker_gpus() == [3]
    assert t.with_workers(3).worker_gpus() == [3, 5, 7]
    with pytest.raises(TopologyError, match=r"workers\.gpus: got \[3, 5, 7\] for 4 workers"):
        t.with_workers(4)


def test_cpu_ignores_gpus() -> None:
    t = parse(_yaml(topology(workers={"count": 1, "gpus": [0]}, ps={"gpu": 0})))
    assert t.worker_gpus() == [] and t.ps_gpu() is None
    assert t.with_workers(4).worker_gpus() == []


def test_yaml_float_forms() -> None:
    # PyYAML reads 1e-3 as a string; the topology takes it as the number.
    t = parse(_yaml(topology()).replace("lr: 0.05", "lr: 1e-3"))
    assert t.train.lr == 0.001


def test_defaults_and_descriptions() -> None:
    t = parse(_yaml(topology()))
    assert t.network.publish_rpc_port is False
    assert t.image_tag == "ps-compose-t:latest"
    assert t.train.data_dir is None
    from orchestrator.topology.fields import Workers
    from orchestrator.topology.messages import section_fields
    from orchestrator.topology.option_sections import Train

    assert "GPU id" in Workers.model_fields["gpus"].description
    assert section_fields(Train)["lr"].description
    assert section_fields(Train)["lr"].is_required()  # the app has a default; a topology file gives it


def _yaml(doc: dict) -> str:
    import yaml

    return yaml.safe_dump(doc, sort_keys=False)


def test_a_topology_without_an_image_section_runs_the_offline_base_on_cpu() -> None:
    from orchestrator import images
    from orchestrator.topology.model import validate

    doc = topology()
    del doc["image"]
    t = validate(doc, "t.yaml")
    assert (t.image.base, t.image.device, t.image.pip_source) == (images.OFFLINE_BASE, "cpu", "wheelhouse")
    assert not t.cuda and t.image_tag == "ps-compose-t:latest"
