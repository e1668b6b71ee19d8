"""The image keeps its base's torch + torchvision, on the offline path standing in
for the CUDA one: no package of the base is replaced, and a base whose pair does
not import stops the build with one line saying so."""

from __future__ import annotations

import io

import pytest

from orchestrator import images
from orchestrator.errors import EngineError

# In the engine group beside `engine` (tests/conftest.py): its projects are its own.
pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.xdist_group("engine-2")]


def _run(engine, image: str, code: str) -> str:
    return engine.containers.run(image, ["python", "-c", code], entrypoint=[], remove=True).decode()


def _packages(engine, image: str) -> dict[str, str]:
    text = _run(
        engine,
        image,
        "import subprocess, sys; sys.stdout.write(subprocess.run("
        "[sys.executable, '-m', 'pip', 'list', '--format=freeze'], capture_output=True, text=True).stdout)",
    )
    return dict(line.split("==", 1) for line in text.split() if "==" in line)


def test_the_image_keeps_every_package_of_its_base(engine, offline_image):
    base = _packages(engine, images.OFFLINE_BASE)
    built = _packages(engine, offline_image)
    assert {"torch", "torchvision"} <= set(base)
    assert {name: built.get(name) for name in base} == base  # nothing replaced, nothing removed
    assert {"scikit-learn", "numpy"} <= set(built)  # the app's own, from the wheelhouse
    assert (
        _run(engine, offline_image, "import torchvision.models as m; print(m.resnet18().fc.out_features)") == "1000\n"
    )


def test_a_base_without_torchvision_stops_the_build_with_one_line(engine, offline_image):
    broken = "psc-test-base-without-torchvision:latest"
    dockerfile = f"FROM {images.OFFLINE_BASE}\nRUN python -m pip uninstall -q -y torchvision\n"
    engine.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=broken, rm=True)
    try:
        with pytest.raises(EngineError) as failed:
            images.build("psc-test-app-without-torchvision:latest", broken, "wheelhouse", out=io.StringIO())
        first = str(failed.value).splitlines()[0]
        assert first.startswith(
            f"image build failed: the base image {broken} has no torch + torchvision "
            "pair that imports (ModuleNotFoundError: No module named 'torchvision')"
        ), first
    finally:
        engine.images.remove(broken, force=True)
