"""Where things are: the project's own files (`HOME`) and the directory runs live in (`ROOT`).

From a checkout (`make`, `python -m orchestrator`, an editable install) both are the checkout,
as before. Installed from a wheel (`pip install .`, `pipx install .`), the project's own files
(images/, requirements/, configs/ and app/: the image's build context) are the copy installed
with the package in <prefix>/share/ps-compose (pyproject.toml's data-files), and runs live in the
directory `ps-compose` is run from, as `docker compose` takes its project directory.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Optional

CHECKOUT = Path(__file__).resolve().parent.parent  # the repository, when the package runs from one
DOCKERFILE = "images/Dockerfile"  # relative to HOME, the build context
DEFAULT_CONFIG = "configs/default.yaml"
SMOKE_CONFIG = "configs/cpu-smoke.yaml"
SHARE = "share/ps-compose"  # under the installation's prefix: pyproject.toml's data-files


def from_checkout(checkout: Path = CHECKOUT) -> bool:
    return (checkout / DOCKERFILE).is_file()


def installed_home(distribution: str = "ps-compose") -> Optional[Path]:
    """The project's files installed with the package (its RECORD lists them), else None."""
    try:
        files = metadata.files(distribution) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.as_posix().endswith(f"{SHARE}/{DOCKERFILE}"):
            return Path(str(f.locate())).resolve().parent.parent
    return None


def _home() -> Path:
    if from_checkout():
        return CHECKOUT
    return installed_home() or CHECKOUT


HOME = _home()  # images/, requirements/, configs/, app/: the build context and the bundled configs
ROOT = CHECKOUT if HOME == CHECKOUT else Path.cwd()  # the compose project directory: runs/, relative paths
RUNS = ROOT / "runs"


def config_file(path: str | Path) -> Path:
    """A topology file: `path` as given, or for a relative one not found there, the project's own
    (`-c configs/cpu-smoke.yaml` from any directory, like the verbs' defaults)."""
    given = Path(path)
    if given.is_absolute() or given.exists() or not (HOME / given).is_file():
        return given
    return HOME / given


def relative(path: Path) -> str:
    """`path` relative to the repository when it is inside it (for messages)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
