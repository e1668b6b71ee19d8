"""The image keeps its base's torch + torchvision, on the offline path standing in
for the CUDA one: no package of the base is replaced, every package is at the
version of the lock requirements/app.txt; a base whose pair does not import stops
the build with one line saying so, and one whose pair is not the lock's (a team's
image, NGC's) builds with one warning naming both versions."""

from __future__ import annotations

import importlib.util
import io
import re
import tarfile

import pytest

from orchestrator import images
from orchestrator.errors import EngineError
from orchestrator.paths import ROOT

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


def _lock(name: str) -> dict[str, str]:
    """name -> version of requirements/<name>.txt, read by the image's own reader (images/requirements.py)."""
    spec = importlib.util.spec_from_file_location("image_requirements", ROOT / "images" / "requirements.py")
    assert spec and spec.loader
    reader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reader)
    return {n: p.version for n, p in reader.read(str(ROOT / "requirements" / f"{name}.txt")).items()}


def _normalized(packages: dict[str, str]) -> dict[str, str]:
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in packages.items()}


def test_the_image_has_the_versions_of_the_app_lock(engine, offline_image):
    """The lock installs what the tests run: every package of requirements/app.txt, at its version,
    in the image the container tests use (the base's part from requirements/torch.txt)."""
    built = _normalized(_packages(engine, offline_image))
    base = _normalized(_packages(engine, images.OFFLINE_BASE))
    app, torch = _lock("app"), _lock("torch")
    assert {name: built.get(name, "missing") for name in app} == app
    assert {name: base.get(name, "missing") for name in torch} == torch
    assert "triton" not in built


def test_a_base_with_another_torch_passes_the_pair_check_with_one_warning_naming_both_versions(engine, offline_image):
    """The Dockerfile's check of the base's pair, run in a base with another torch: one warning,
    exit 0, so the build goes on (a build prints a step's warning: test_images.py)."""
    other = "psc-test-base-other-torch:latest"
    # The same files under another version number: what a base with another pair looks like to the check.
    dockerfile = (
        f"FROM {images.OFFLINE_BASE}\n"
        "RUN cd /opt/venv/lib/python3.11/site-packages && mv torch-*.dist-info torch-2.8.0.dist-info"
        " && sed -i 's/^Version: .*/Version: 2.8.0/' torch-2.8.0.dist-info/METADATA\n"
        "COPY images/requirements.py requirements/app.txt /tmp/build/\n"
    )
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        tar.addfile(_file("Dockerfile", dockerfile.encode()), io.BytesIO(dockerfile.encode()))
        for name in ("images/requirements.py", "requirements/app.txt"):
            data = (ROOT / name).read_bytes()
            tar.addfile(_file(name, data), io.BytesIO(data))
    context.seek(0)
    engine.images.build(fileobj=context, custom_context=True, tag=other, rm=True)
    try:
        check = "python /tmp/build/requirements.py /tmp/build/app.txt --check-pair BASE 2>&1; echo status=$?"
        said = engine.containers.run(other, ["sh", "-c", check], entrypoint=[], remove=True).decode().splitlines()
        assert said[-1] == "status=0" and len(said) == 2, said
        assert said[0].startswith("warning: the base image BASE has torch 2.8.0 (the lock: "), said
    finally:
        engine.images.remove(other, force=True)


def _file(name: str, data: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info


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


def test_every_module_a_ps_or_worker_imports_from_the_app_or_the_standard_library_has_its_bytecode(
    engine, offline_image
):
    """The containers run as psc and cannot write bytecode: the image brings it, so no process
    (a health check every few seconds among them) compiles the app or the standard library again."""
    code = (
        "import importlib.util, os, sys, sysconfig\n"
        "import app.ps.process, app.worker.process, app.__main__\n"
        "roots = ('/opt/ps-compose/app/', sysconfig.get_paths()['stdlib'] + '/')\n"
        "files = [getattr(m, '__file__', None) or '' for m in list(sys.modules.values())]\n"
        "ours = [f for f in files if f.startswith(roots) and f.endswith('.py')]\n"
        "print(len(ours), sorted(f for f in ours if not os.path.exists(importlib.util.cache_from_source(f))))\n"
    )
    out = engine.containers.run(offline_image, ["python", "-c", code], entrypoint=[], remove=True, user="psc")
    count, missing = out.decode().split(" ", 1)
    assert int(count) > 100 and missing.strip() == "[]", out.decode()
