"""A topology's own packages (`image.packages`, `image.requirements`): read, checked in the
Python `local` runs, resolved on this host, and installed in a layer of their own over the
app's image.

The resolution is pip's (`pip install --dry-run --report`) for the image's interpreter
(CPython 3.11, manylinux x86_64), constrained to the versions the image already has (the
locks requirements/app.txt and requirements/torch.txt): nothing of the image is replaced,
and a package that needs another version of one of them is one line saying so. What the
image lacks of the result is pinned with its hash and installed with `--no-deps
--require-hashes`, as the app's own packages are: from the index, or on the offline path
from wheels fetched here (images/.cache/packages/<key>/), with `--no-index`. The layer's
image carries the key of the requirement lines as a label, so a changed list builds it again.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, TextIO

from orchestrator.errors import EngineError, UsageError, last_line
from orchestrator.host_paths import resolve
from orchestrator.paths import HOME, ROOT

LABEL = "ps-compose.packages"  # the key of the requirement lines the image's layer installed
INSTALLED = "ps-compose.packages.installed"  # what it installed: name==version, space-separated
CACHE = HOME / "images" / ".cache" / "packages"
# The image's interpreter: pip picks wheels for these tags only (as images/wheelhouse.sh does).
TARGET = [
    "--only-binary=:all:",
    "--implementation",
    "cp",
    "--python-version",
    "3.11",
    "--abi",
    "cp311",
    "--platform",
    "manylinux2014_x86_64",
    *[arg for v in range(17, 37) for arg in ("--platform", f"manylinux_2_{v}_x86_64")],
]
# What the image has without being in a lock: torch's dependency the offline image leaves out.
IMAGE_LACKS_ON_PURPOSE = frozenset({"triton"})


@dataclass(frozen=True)
class Wheel:
    """One package the layer installs: its name, version, where pip found it and its sha256."""

    name: str
    version: str
    url: str
    sha256: str

    def pin(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}\n"


def pip() -> list[str]:
    """This interpreter's pip; else the system's (a pipx venv may have none of its own)."""
    import importlib.util

    return [sys.executable, "-m", "pip"] if importlib.util.find_spec("pip") else ["python3", "-m", "pip"]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(t: Any, base: Path = ROOT) -> list[str]:
    """`image.packages`, then the requirement lines of `image.requirements` (comments and blank
    lines dropped); UsageError naming the file and line of one that is not a requirement."""
    from orchestrator.topology.fields import requirement_problem

    lines = list(t.image.packages)
    if t.image.requirements is None:
        return lines
    path = resolve(t.image.requirements, base)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"image.requirements: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        problem = requirement_problem(line)
        if problem:
            raise UsageError(f"image.requirements: {path} line {number}: got {line!r}; {problem}")
        lines.append(line)
    return lines


def key(lines: list[str]) -> str:
    """What names the layer: the requirement lines, in order (and the rule that resolves them)."""
    return hashlib.sha256(("v1\n" + "\n".join(lines)).encode()).hexdigest()[:16]


# --- local: the Python that runs the app ---------------------------------------------------------


def not_installed(lines: list[str]) -> list[str]:
    """The requirements this interpreter does not satisfy (missing, or at a version outside the
    line's), each as `line (have X)` or the line alone."""
    from packaging.requirements import Requirement

    missing = []
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(line)
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            missing.append(f"{line} (have {have})")
    return missing


def check_local(t: Any, python: str = sys.executable) -> dict[str, str]:
    """UsageError (one line, exit 2) naming every requirement `local`'s Python lacks; else the
    installed versions of the named packages (recorded with the run)."""
    from packaging.requirements import Requirement

    lines = requirement_lines(t)
    missing = not_installed(lines)
    if missing:
        raise UsageError(
            f"image.packages: {python} lacks {', '.join(missing)}; install them there "
            f"({python} -m pip install {' '.join(repr(m.split(' (')[0]) for m in missing)}) or run in containers"
        )
    names = [Requirement(line).name for line in lines]
    return {n: metadata.version(n) for n in names if _installed(n)}


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


# --- containers: resolved here, a layer over the app's image ---------------------------------------


def image_has() -> dict[str, str]:
    """Normalised name -> version of what the app's image holds: the locks app.txt and torch.txt."""
    found: dict[str, str] = {}
    for lock in ("app", "torch"):
        text = (HOME / "requirements" / f"{lock}.txt").read_text(encoding="utf-8")
        for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)", text, re.M):
            found[normalize(m.group(1))] = m.group(2)
    return found


def resolve_wheels(lines: list[str], work: Path, out: TextIO) -> list[Wheel]:
    """The packages the layer installs: pip's resolution of `lines` for the image's interpreter,
    constrained to the image's versions, less what the image has. UsageError with pip's last
    line when it cannot resolve (a name the index lacks, a version the image rules out)."""
    has = image_has()
    work.mkdir(parents=True, exist_ok=True)
    (work / "requirements.in").write_text("".join(f"{line}\n" for line in lines))
    (work / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(has.items())))
    report = work / "report.json"
    argv = [
        *pip(),
        "install",
        "--quiet",
        "--dry-run",
        "--ignore-installed",
        "--disable-pip-version-check",
        "--target",
        str(work / "never-written"),
        "--report",
        str(report),
        *TARGET,
        "-c",
        str(work / "constraints.txt"),
        "-r",
        str(work / "requirements.in"),
    ]
    print(f"==> image.packages: resolving {', '.join(lines)} against the image's packages", file=out, flush=True)
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        said = [x for x in r.stderr.splitlines() if x.startswith("ERROR:")]
        why = said[0].removeprefix("ERROR: ") if said else last_line(r.stderr) or f"exit status {r.returncode}"
        raise UsageError(f"image.packages: pip cannot install {', '.join(lines)} beside the image's packages: {why}")
    return wheels_of(json.loads(report.read_text()), has)


def wheels_of(report: dict[str, Any], has: dict[str, str]) -> list[Wheel]:
    """The entries of pip's installation report the image lacks, pinned with their hashes."""
    wheels = []
    for item in report.get("install", []):
        name = item["metadata"]["name"]
        if normalize(name) in has or normalize(name) in IMAGE_LACKS_ON_PURPOSE:
            continue
        info = item["download_info"]
        hashes = info.get("archive_info", {}).get("hashes", {})
        sha = hashes.get("sha256") or info.get("archive_info", {}).get("hash", "").removeprefix("sha256=")
        if not sha:
            raise EngineError(f"image.packages: pip gave no sha256 for {name} ({info.get('url')})")
        wheels.append(Wheel(normalize(name), item["metadata"]["version"], info["url"], sha))
    return sorted(wheels, key=lambda w: w.name)


def fetch(wheels: list[Wheel], into: Path) -> None:
    """The wheels, checked against their hashes, into `into` (the offline path's layer)."""
    into.mkdir(parents=True, exist_ok=True)
    (into / "requirements.txt").write_text("".join(w.pin() for w in wheels))
    argv = [*pip(), "download", "--quiet", "--disable-pip-version-check", "--no-deps"]
    argv += ["--require-hashes", *TARGET, "-d", str(into), "-r", str(into / "requirements.txt")]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise EngineError(f"image.packages: fetching the wheels failed: {last_line(r.stderr)}")


LAYER = """\
FROM {image}
USER root
COPY packages/ /tmp/packages/
RUN set -eu; \\
    PIP_BREAK_SYSTEM_PACKAGES=1 python -m pip install --no-deps --require-hashes {source} \\
        -r /tmp/packages/requirements.txt; \\
    rm -rf /tmp/packages; \\
    python -m compileall -q -j 0 $(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \\
        >/dev/null || true
USER psc
LABEL {label}="{key}" {installed}="{pins}"
"""


def layer_context(image: str, wheels: list[Wheel], pip_source: str, wheel_dir: Optional[Path], label: str) -> bytes:
    """The build context of the layer, as a tar: its Dockerfile and packages/ (the pins, and on
    the offline path the wheels)."""
    source = "--no-index --find-links /tmp/packages" if pip_source == "wheelhouse" else ""
    pins = " ".join(f"{w.name}=={w.version}" for w in wheels)
    dockerfile = LAYER.format(image=image, source=source, label=LABEL, key=label, installed=INSTALLED, pins=pins)
    files: dict[str, bytes] = {
        "Dockerfile": dockerfile.encode(),
        "packages/requirements.txt": "".join(w.pin() for w in wheels).encode(),
    }
    if pip_source == "wheelhouse" and wheel_dir is not None:
        for wheel in sorted(wheel_dir.glob("*.whl")):
            files[f"packages/{wheel.name}"] = wheel.read_bytes()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def image_labels(client: Any, tag: str) -> Optional[dict[str, str]]:
    """Image `tag`'s labels; None when there is no such image."""
    import docker.errors

    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    return dict(image.labels or {})


def is_current(labels: Optional[dict[str, str]], lines: list[str]) -> bool:
    """Whether an image with `labels` has the layer of `lines` (none for no lines)."""
    return labels is not None and labels.get(LABEL, "") == (key(lines) if lines else "")


def installed_in(labels: Optional[dict[str, str]]) -> dict[str, str]:
    """What an image's packages layer installed, by name ({} for none)."""
    pins = (labels or {}).get(INSTALLED, "")
    return dict(pin.split("==", 1) for pin in pins.split() if "==" in pin)


def build_layer(client: Any, tag: str, lines: list[str], pip_source: str, out: TextIO) -> dict[str, str]:
    """Image `tag` again: the app's image of that tag with the layer of `lines` over it; the
    versions the layer installed, by name."""
    from orchestrator import images

    label = key(lines)
    work = CACHE / label
    wheels = resolve_wheels(lines, work, out)
    wheel_dir = work / "wheels"
    if pip_source == "wheelhouse":
        fetch(wheels, wheel_dir)
    context = layer_context(tag, wheels, pip_source, wheel_dir, label)
    images.stream_build(
        client, tag, tag, pip_source, out, what="image.packages, ", fileobj=io.BytesIO(context), custom_context=True
    )
    return {w.name: w.version for w in wheels}


def record(run_dir: Path, versions: dict[str, str]) -> Optional[Path]:
    """Keep with the run the versions its packages had (runs/<name>/packages.json); none: no file."""
    path = run_dir / "packages.json"
    if not versions:
        path.unlink(missing_ok=True)
        return None
    from orchestrator.render.yamlio import write_atomic

    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(dict(sorted(versions.items())), indent=2) + "\n")
    return path


def described(versions: dict[str, str]) -> str:
    return ", ".join(f"{n} {v}" for n, v in sorted(versions.items()))
