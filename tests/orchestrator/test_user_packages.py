"""The topology's own packages (image.packages, image.requirements): each line a pip
requirement or one line naming the field, the value and what is allowed; `local` refuses in
one line a Python that lacks one, and records the versions it has; the layer over the app's
image installs what pip resolved less what the image holds, pinned by hash, and says so in
its labels. (The layer built and run: tests/containers/test_env_containers.py.)"""

from __future__ import annotations

import io
import json
import tarfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from orchestrator import user_packages
from orchestrator.errors import UsageError
from orchestrator.topology.model import load

from orch_helpers import REPO, cli  # noqa: F401 - cli is a fixture

SMOKE = REPO / "configs/cpu-smoke.yaml"
PYTEST = metadata.version("pytest")


def topology(tmp_path: Path, **image) -> Path:
    doc = yaml.safe_load(SMOKE.read_text())
    doc["image"].update(image)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(
    "bad, said",
    [
        ("two words", "must be a pip requirement like einops or timm==1.0.*"),
        ("-e .", "options such as -e or --index-url are not taken"),
        ("pkg @ https://example.org/pkg.whl", "not a URL"),
    ],
)
def test_a_line_that_is_not_a_requirement_is_one_line_and_exit_2(cli, tmp_path: Path, bad: str, said: str) -> None:  # noqa: F811
    status, out, err = cli("render", "-c", str(topology(tmp_path, packages=["einops", bad])), "-o", "c.yaml")
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "image.packages" in err and repr(bad) in err and said in err, err
    assert not (tmp_path / "c.yaml").exists()


def test_the_requirements_file_joins_the_list_and_a_bad_line_is_named_by_number(tmp_path: Path) -> None:
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("# the model's\n\ntimm==1.0.*  # its backbones\neinops\n")
    t = load(topology(tmp_path, packages=["safetensors>=0.4"], requirements=str(reqs)))
    assert user_packages.requirement_lines(t) == ["safetensors>=0.4", "timm==1.0.*", "einops"]
    reqs.write_text("einops\n--index-url https://mirror.example/simple\n")
    with pytest.raises(UsageError, match=rf"image.requirements: {reqs} line 2: got '--index-url https://"):
        user_packages.requirement_lines(t)
    reqs.unlink()
    with pytest.raises(UsageError, match=rf"image.requirements: cannot read {reqs}"):
        user_packages.requirement_lines(t)


def test_local_names_each_requirement_its_python_lacks_and_starts_nothing(cli, tmp_path: Path) -> None:  # noqa: F811
    config = topology(tmp_path, packages=["pytest", "no-such-package-psc", f"pytest<{PYTEST}"])
    status, out, err = cli("local", "-c", str(config))
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert f"lacks no-such-package-psc, pytest<{PYTEST} (have {PYTEST}); install them there" in err
    assert not (tmp_path / "runs").exists()


def test_local_records_the_versions_its_python_has(tmp_path: Path) -> None:
    t = load(topology(tmp_path, packages=["pytest>=7", "PyYAML"]))
    versions = user_packages.check_local(t)
    assert versions == {"pytest": PYTEST, "PyYAML": metadata.version("PyYAML")}
    written = user_packages.record(tmp_path / "run", versions)
    assert written is not None and json.loads(written.read_text()) == {"PyYAML": versions["PyYAML"], "pytest": PYTEST}
    assert user_packages.record(tmp_path / "run", {}) is None and not written.exists()  # none now: no stale file


def _entry(name: str, version: str, sha: str = "ab" * 32) -> dict:
    return {
        "metadata": {"name": name, "version": version},
        "download_info": {"url": f"https://files.example/{name}.whl", "archive_info": {"hashes": {"sha256": sha}}},
    }


def test_the_layer_installs_what_pip_resolved_less_what_the_image_holds_pinned_by_hash() -> None:
    has = user_packages.image_has()
    assert {"torch", "torchvision", "numpy", "pyzmq"} <= set(has)  # both locks: the base's and the app's
    report = {"install": [_entry("timm", "1.0.31"), _entry("torch", has["torch"]), _entry("Hugging_Face-Hub", "2.4.0")]}
    report["install"].append(_entry("triton", "3.8.0"))  # torch's, left out of the image on purpose
    wheels = user_packages.wheels_of(report, has)
    assert [(w.name, w.version) for w in wheels] == [("hugging-face-hub", "2.4.0"), ("timm", "1.0.31")]
    assert wheels[1].pin() == f"timm==1.0.31 --hash=sha256:{'ab' * 32}\n"


@pytest.mark.parametrize("source, flags", [("wheelhouse", "--no-index --find-links /tmp/packages"), ("index", "")])
def test_the_layer_builds_from_the_apps_image_and_labels_what_it_installed(
    tmp_path: Path, source: str, flags: str
) -> None:
    wheels = [user_packages.Wheel("einops", "0.8.2", "https://files.example/einops.whl", "cd" * 32)]
    (tmp_path / "einops-0.8.2-py3-none-any.whl").write_bytes(b"a wheel")
    context = user_packages.layer_context("ps-compose-x:latest", wheels, source, tmp_path, "k" * 16)
    with tarfile.open(fileobj=io.BytesIO(context)) as tar:
        files = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}  # type: ignore[union-attr]
    dockerfile = files["Dockerfile"]
    assert dockerfile.startswith("FROM ps-compose-x:latest\nUSER root\n") and "USER psc\n" in dockerfile
    assert f"pip install --no-deps --require-hashes {flags}".rstrip() in dockerfile
    assert f'LABEL ps-compose.packages="{"k" * 16}" ps-compose.packages.installed="einops==0.8.2"' in dockerfile
    assert files["packages/requirements.txt"] == f"einops==0.8.2 --hash=sha256:{'cd' * 32}\n"
    assert ("packages/einops-0.8.2-py3-none-any.whl" in files) == (source == "wheelhouse")


def test_an_image_is_current_when_its_label_is_the_lines_key() -> None:
    lines = ["einops"]
    assert user_packages.is_current({}, []) and not user_packages.is_current(None, [])
    assert not user_packages.is_current({}, lines)
    labels = {user_packages.LABEL: user_packages.key(lines), user_packages.INSTALLED: "einops==0.8.2 six==1.16.0"}
    assert user_packages.is_current(labels, lines) and not user_packages.is_current(labels, ["einops", "six"])
    assert not user_packages.is_current(labels, [])  # the layer of packages no longer asked for: built again
    assert user_packages.installed_in(labels) == {"einops": "0.8.2", "six": "1.16.0"}
