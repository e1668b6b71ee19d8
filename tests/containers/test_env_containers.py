"""The user's whole project in real containers: a package of `image.packages` (einops, from the
index, fetched on this host as a wheel for the offline path) is installed in a layer of the
run's own image and the user's model imports it; a variable of the caller's named in `env`
reaches every process of a compose run (the user's dataset factory reads it, in the PS and in
each worker), and its value is in no rendered file; a volume an override file (`up -f`) adds
is mounted in each of them. The versions installed are recorded with the run."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path

import pytest
import yaml

from orchestrator.backends.compose import adapter
from orchestrator.backends.registry import get
from orchestrator.paths import ROOT
from orchestrator.verbs import cluster as verbs

pytestmark = [pytest.mark.slow, pytest.mark.docker]
VALUE = f"token-{uuid.uuid4().hex}"
MARKER = f"marker-{uuid.uuid4().hex}"
FACTORY = """
import os

import torch
from torch.utils.data import TensorDataset


def data(root, train, seed):
    token = os.environ.get("MY_TOKEN")
    if token != %r:
        raise RuntimeError(f"MY_TOKEN is {token!r}")
    with open("/extra/marker") as f:  # the override file's volume
        if f.read() != %r:
            raise RuntimeError("/extra/marker is not the host's")
    g = torch.Generator().manual_seed(0 if train else 1)
    return TensorDataset(torch.rand(64, 1, 8, 8, generator=g), torch.randint(10, (64,), generator=g)), 1, 10


def model(num_classes, channels):
    import einops.layers.torch  # the topology's image.packages

    return torch.nn.Sequential(
        einops.layers.torch.Rearrange("b c h w -> b (c h w)"), torch.nn.Linear(channels * 64, num_classes)
    )
"""


def test_a_named_variable_and_an_override_files_volume_reach_every_process_and_no_rendered_file(
    engine, offline_image, tmp_path, monkeypatch
):
    code = Path(tempfile.mkdtemp(prefix="psc-env-code-"))  # readable by the containers' user
    try:
        (code / "envdata.py").write_text(FACTORY % (VALUE, MARKER))
        (code / "extra").mkdir()
        (code / "extra" / "marker").write_text(MARKER)
        (code / "extra").chmod(0o755)
        (code / "extra" / "marker").chmod(0o644)
        mount = {"volumes": [{"type": "bind", "source": str(code / "extra"), "target": "/extra", "read_only": True}]}
        override = tmp_path / "extra.yaml"
        override.write_text(yaml.safe_dump({"services": {s: mount for s in ("ps", "worker1", "worker2")}}))
        code.chmod(0o755)
        (code / "envdata.py").chmod(stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
        project = f"psc-env-{uuid.uuid4().hex[:6]}"
        doc = yaml.safe_load((ROOT / "configs/cpu-smoke.yaml").read_text())
        doc["image"].update(tag=f"{project}:latest", packages=["einops"])  # an image of its own: the layer
        doc["train"].update(dataset="envdata:data", model="envdata:model", epochs=1)
        doc["train"].pop("data_dir", None)
        doc.update(code=str(code), env=["MY_TOKEN"])
        config = tmp_path / "topo.yaml"
        config.write_text(yaml.safe_dump(doc))
        monkeypatch.setenv("MY_TOKEN", VALUE)
        try:
            out = io.StringIO()
            up = verbs.up(get("compose"), str(config), name=project, remember=False, out=out, files=[str(override)])
            assert up == 0, out.getvalue()
            states = adapter.wait_exited(engine, project, 4, 300, io.StringIO())
            logs = {s: adapter.log_text(engine, project, s) for s in ("ps", "worker1", "worker2")}
            rendered = [p for p in (ROOT / "runs" / project).rglob("*") if p.is_file()]
            texts = {str(p): p.read_bytes() for p in rendered}
            packages = json.loads((ROOT / "runs" / project / "packages.json").read_text())
        finally:
            down = io.StringIO()
            verbs.down(get("compose"), str(config), volumes=True, name=project, out=down, files=[str(override)])
            shutil.rmtree(ROOT / "runs" / project, ignore_errors=True)
            engine.images.remove(f"{project}:latest", force=True)
    finally:
        shutil.rmtree(code, ignore_errors=True)
    assert states is not None, logs
    assert {s.service: s.exit_code for s in states if s.service != "pidns"} == {"ps": 0, "worker1": 0, "worker2": 0}, (
        logs
    )
    assert any(name.endswith("compose.yaml") for name in texts) and all(VALUE.encode() not in t for t in texts.values())
    assert os.environ["MY_TOKEN"] == VALUE
    assert set(packages) == {"einops"} and f"==> image.packages: einops {packages['einops']}" in out.getvalue()
