"""The image recipe and the build's progress stream. No engine needed."""

import io
import re
import subprocess
import sys

import pytest
from docker.utils.build import exclude_paths

from orchestrator import images
from orchestrator.errors import EngineError
from orchestrator.paths import ROOT
from orchestrator.topology.model import load

ROOT = ROOT


def test_dockerfile_default_base_is_the_default_topologys():
    text = (ROOT / "images" / "Dockerfile").read_text()
    default = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.MULTILINE).group(1)
    assert default == load(ROOT / "configs" / "default.yaml").image.base
    assert 'ENTRYPOINT ["python", "-m", "app"]' in text
    assert "USER psc" in text


def test_the_default_base_is_the_official_image_of_the_locked_torch():
    """One torch: the CUDA image's default base ships the pair the venv and the offline image have."""
    text = (ROOT / "images" / "Dockerfile").read_text()
    default = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.MULTILINE).group(1)
    torch = re.search(r"^torch==(\S+)", (ROOT / "requirements" / "app.txt").read_text(), re.MULTILINE).group(1)
    assert re.fullmatch(rf"pytorch/pytorch:{re.escape(torch)}-cuda[\d.]+-cudnn\d+-runtime", default), (default, torch)


def test_build_context_is_small():
    files = exclude_paths(str(ROOT), (ROOT / ".dockerignore").read_text().splitlines())
    assert "requirements/app.txt" in files and "app/__main__.py" in files
    assert not [f for f in files if f.startswith((".venv", "runs/", ".git/", "tests/"))]
    assert not [f for f in files if "__pycache__" in f]


def test_the_image_installs_the_app_lock_less_what_the_offline_base_has():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "images" / "requirements.py"),
            str(ROOT / "requirements" / "app.txt"),
            "--without",
            str(ROOT / "requirements" / "torch.txt"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    names = {line.split("==")[0] for line in out.stdout.splitlines() if "==" in line}
    hashes = [line for line in out.stdout.splitlines() if line.strip().startswith("--hash=sha256:")]
    assert {"numpy", "scikit-learn", "tensorboard"} & names == {"scikit-learn", "tensorboard"}  # numpy: the base's
    assert not {"torch", "torchvision"} & names
    assert len(hashes) >= len(names)


def test_source_per_topology():
    smoke = load(ROOT / "configs" / "cpu-smoke.yaml")
    default = load(ROOT / "configs" / "default.yaml")
    assert images.source(smoke) == ("ps-compose-base:bookworm", "wheelhouse")
    assert images.source(default) == (default.image.base, "index")
    assert images.source(default, offline=True) == ("ps-compose-base:bookworm", "wheelhouse")


def test_follow_build_prints_steps_and_returns_the_id():
    stream = [
        {"stream": "Step 1/2 : FROM x\n"},
        {"stream": " ---> abc\n"},
        {"stream": "Step 2/2 : RUN pip install\n"},
        {"stream": "Collecting torch\n"},
        {"aux": {"ID": "sha256:1234"}},
        {"stream": "Successfully built 1234\n"},
    ]
    out = io.StringIO()
    assert images.follow_build(stream, out) == "sha256:1234"
    assert out.getvalue() == "    Step 1/2 : FROM x\n    Step 2/2 : RUN pip install\n"


def test_follow_build_shows_a_steps_warning_without_its_colour():
    stream = [
        {"stream": "Step 1/1 : RUN check\n"},
        {"stream": "\x1b[91mwarning: the base image b has torch 2.8.0 (the lock: 2.14.1): kept\n\x1b[0m"},
        {"stream": "note: not a warning\n"},
        {"aux": {"ID": "sha256:1234"}},
    ]
    out = io.StringIO()
    assert images.follow_build(stream, out) == "sha256:1234"
    assert out.getvalue() == (
        "    Step 1/1 : RUN check\n      warning: the base image b has torch 2.8.0 (the lock: 2.14.1): kept\n"
    )


def test_follow_build_error_shows_the_failing_steps_output():
    stream = [
        {"stream": "Step 8/14 : RUN pip install\n"},
        {"stream": "ERROR: No matching distribution for torch\n"},
        {"error": "The command returned a non-zero code: 1", "errorDetail": {"message": "non-zero code: 1"}},
    ]
    with pytest.raises(EngineError, match=r"(?s)image build failed: The command.*No matching distribution"):
        images.follow_build(stream, io.StringIO())


def test_follow_build_error_is_the_steps_own_error_line():
    stream = [
        {"stream": "Step 5/15 : RUN set -eu; if ! python -c 'import torch, torchvision'...\n"},
        {"stream": "\x1b[91merror: the base image x has no torch + torchvision pair that imports (boom)\n\x1b[0m"},
        {"error": "The command '/bin/sh -c set -eu; ...' returned a non-zero code: 1"},
    ]
    with pytest.raises(EngineError) as failed:
        images.follow_build(stream, io.StringIO())
    assert str(failed.value).splitlines()[0] == (
        "image build failed: the base image x has no torch + torchvision pair that imports (boom)"
    )
