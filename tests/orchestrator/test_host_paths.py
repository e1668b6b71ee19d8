"""`code` (the user's Python code), entry points and train.init_weights: validation and render."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from orchestrator.render import compose as render_compose
from orchestrator.render import swarm as render_swarm
from orchestrator.topology.model import TopologyError, load, parse
from orchestrator.verbs.local import local_environment

from orch_helpers import REPO, topology, training

CUSTOM = topology(code="./mycode", train={"model": "mynet.model:build", "dataset": "mynet.data:load"})


def _tree(root: Path) -> None:
    (root / "mycode" / "mynet").mkdir(parents=True)
    (root / "mycode" / "mynet" / "model.py").write_text("")
    (root / "mycode" / "mynet" / "data").mkdir()
    (root / "mycode" / "mynet" / "data" / "__init__.py").write_text("")
    (root / "w.pt").write_bytes(b"")


def test_an_entry_point_without_code_names_the_field() -> None:
    doc = topology(train={"model": "mynet.model:build"})
    with pytest.raises(TopologyError) as e:
        parse(yaml.safe_dump(doc), "t.yaml")
    assert str(e.value) == (
        "t.yaml: train.model: got 'mynet.model:build'; an entry point needs the "
        "top-level `code` (the directory of your Python code)"
    )


@pytest.mark.parametrize(
    "field, value, expected",
    [
        (
            "model",
            "mynet.model",
            "train.model: got 'mynet.model'; must be a model name like cnn or resnet18, "
            "or an entry point package.module:factory",
        ),
        (
            "dataset",
            "mynet:data:x",
            "train.dataset: got 'mynet:data:x'; must be one of imagefolder, mnist, "
            "cifar10, digits, synthetic, stdlib_text, webdataset, or an entry point package.module:factory",
        ),
    ],
)
def test_a_malformed_entry_point_is_rejected(field: str, value: str, expected: str) -> None:
    with pytest.raises(TopologyError, match="^t.yaml: " + expected.replace("(", r"\(").replace(")", r"\)")):
        parse(yaml.safe_dump(topology(code="./c", train={field: value})), "t.yaml")


# (id, change to CUSTOM, text the one error line must contain)
BAD_PATHS = [
    (
        "code-missing",
        {"code": "./nope"},
        "code: got './nope'; must be a directory of Python code on this host (it does not exist",
    ),
    (
        "code-is-a-file",
        {"code": "./w.pt"},
        "code: got './w.pt'; must be a directory of Python code on this host (it is a file",
    ),
    (
        "module-not-in-code",
        {"train": {"model": "other.net:build"}},
        "train.model: got 'other.net:build'; its module must be in code './mycode' as other/net.py or "
        "other/net/__init__.py",
    ),
    (
        "dataset-module-not-in-code",
        {"train": {"dataset": "mynet.nodata:load"}},
        "train.dataset: got 'mynet.nodata:load'; its module must be in code './mycode' as mynet/nodata.py or",
    ),
    (
        "weights-missing",
        {"train": {"init_weights": "./missing.pt"}},
        "train.init_weights: got './missing.pt'; must be a state dict file on this host (no such file",
    ),
]


@pytest.mark.parametrize("change, expected", [b[1:] for b in BAD_PATHS], ids=[b[0] for b in BAD_PATHS])
@pytest.mark.parametrize("target", ["compose", "swarm"])
def test_render_checks_host_paths_and_writes_nothing(
    cli, write_config, tmp_path: Path, change, expected, target: str
) -> None:
    _tree(tmp_path)
    doc = topology(**CUSTOM)
    for key, value in change.items():
        doc[key] = {**doc[key], **value} if isinstance(value, dict) else value
    config = write_config(doc)
    status, stdout, stderr = cli("render", "-c", str(config), "--target", target, "-o", "out.yaml")
    assert status == 2
    assert len(stderr.splitlines()) == 1 and expected in stderr, stderr
    assert stdout == "" and not (tmp_path / "out.yaml").exists()


def test_code_and_weights_are_read_only_mounts_on_every_service(cli, write_config, tmp_path: Path) -> None:
    _tree(tmp_path)
    config = write_config(topology(**{**CUSTOM, "train": {**CUSTOM["train"], "init_weights": "w.pt"}}))
    status, _, stderr = cli("render", "-c", str(config), "-o", "compose.yaml")
    assert status == 0, stderr
    doc = yaml.safe_load((tmp_path / "compose.yaml").read_text())
    for _name, svc in training(doc).items():
        assert {"type": "bind", "source": "./mycode", "target": "/code", "read_only": True} in svc["volumes"]
        assert {"type": "bind", "source": "./w.pt", "target": "/init/weights.pt", "read_only": True} in svc["volumes"]
        env = svc["environment"]
        assert env["PYTHONPATH"] == "/opt/ps-compose:/code"
        assert env["PSC_INIT_WEIGHTS"] == "/init/weights.pt"
        assert (env["PSC_MODEL"], env["PSC_DATASET"]) == ("mynet.model:build", "mynet.data:load")
        assert "PSC_DATA_DIR" not in env  # the user's dataset reads data_dir only when one is given


def test_the_image_stays_free_of_user_code() -> None:
    # The Dockerfile copies the app only: the user's code comes by the mount.
    copies = [line for line in (REPO / "images" / "Dockerfile").read_text().splitlines() if line.startswith("COPY")]
    assert not any("examples" in line or "/code" in line for line in copies)


def test_swarm_makes_code_and_weights_absolute() -> None:
    t = parse(yaml.safe_dump(topology(**{**CUSTOM, "train": {**CUSTOM["train"], "init_weights": "w.pt"}})))
    doc = render_swarm.render(t, data_root="/srv/psc")
    for svc in training(doc).values():
        sources = {v["target"]: v["source"] for v in svc["volumes"] if v["type"] == "bind"}
        assert sources == {"/code": "/srv/psc/mycode", "/init/weights.pt": "/srv/psc/w.pt"}


def test_local_puts_code_first_on_pythonpath_and_weights_absolute(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/already/there")
    t = parse(yaml.safe_dump(topology(**{**CUSTOM, "train": {**CUSTOM["train"], "init_weights": "w.pt"}})))
    env = local_environment(t, 1, port=1234, run_dir=tmp_path / "run", ifname="lo")
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path / "mycode"), "/already/there"])
    assert env["PSC_INIT_WEIGHTS"] == str(tmp_path / "w.pt")


def test_the_example_topology_is_valid_and_its_paths_exist() -> None:
    from orchestrator.host_paths import check_paths

    t = load(REPO / "examples" / "custom" / "topology.yaml")
    check_paths(t, "examples/custom/topology.yaml", REPO)
    assert t.reads_files and t.code == "./examples/custom"


def test_image_cache_reaches_every_process_unless_auto() -> None:
    cases = (
        (topology(train={"image_cache": True}), "memory"),
        (topology(train={"image_cache": "file"}), "file"),
        ("off", "off"),
        (topology(), None),
    )
    for doc, expected in cases:
        text = (
            yaml.safe_dump(topology(train={"image_cache": False})).replace("image_cache: false", "image_cache: off")
            if doc == "off"
            else yaml.safe_dump(doc)
        )  # a bare YAML off (a boolean to PyYAML) is off
        t = parse(text)
        assert t.train.image_cache == (expected or "auto")
        for svc in training(render_compose.render(t)).values():
            assert svc["environment"].get("PSC_IMAGE_CACHE") == expected


def test_loader_workers_auto_is_told_the_workers_on_the_host_and_the_cache_dir_is_on_the_state_volume(
    tmp_path: Path,
) -> None:
    images = topology(train={"dataset": "imagefolder", "data_dir": "./data"}, workers={"count": 3})
    auto = parse(yaml.safe_dump(images))
    for svc in training(render_compose.render(auto)).values():
        env = svc["environment"]
        assert (env["PSC_LOADER_WORKERS"], env["PSC_HOST_WORKERS"]) == ("auto", "3")
        assert env["PSC_CACHE_DIR"] == render_compose.CACHE_DIR
        assert render_compose.CACHE_DIR.startswith(render_compose.STATE_DIR + "/")
    fixed = parse(yaml.safe_dump(topology(train={"loader_workers": 2})))
    for svc in training(render_compose.render(fixed)).values():
        assert svc["environment"]["PSC_LOADER_WORKERS"] == "2" and "PSC_HOST_WORKERS" not in svc["environment"]
        assert "PSC_CACHE_DIR" not in svc["environment"]  # no image cache for digits
    env = local_environment(auto, 1, port=1234, run_dir=tmp_path / "run", ifname="lo")
    assert env["PSC_CACHE_DIR"] == str((tmp_path / "run" / "cache").resolve())
