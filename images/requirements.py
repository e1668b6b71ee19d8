"""Print one extra's requirements from pyproject.toml, one per line.

Used on the host (images/wheelhouse.sh) and inside the image build, so the
dependency layer is built from pyproject.toml alone, before the app's code is
copied: editing app/ does not reinstall anything.

    python images/requirements.py pyproject.toml app [--without torch torchvision]
"""

import re
import sys

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # older Pythons: pip vendors the same parser
    from pip._vendor import tomli as tomllib


def project_name(requirement: str) -> str:
    """The distribution name a requirement string starts with, normalised (PEP 503)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else ""


def extra_requirements(pyproject_text: str, extra: str, without: tuple[str, ...] = ()) -> list[str]:
    """The requirement strings of `[project.optional-dependencies].<extra>`, less `without`."""
    project = tomllib.loads(pyproject_text)["project"]
    found = list(project.get("dependencies", [])) + list(project["optional-dependencies"][extra])
    skip = {project_name(name) for name in without}
    return [r for r in found if project_name(r) not in skip]


def main(argv: list[str]) -> int:
    path, extra, *rest = argv
    without = tuple(rest[1:]) if rest[:1] == ["--without"] else ()
    with open(path, encoding="utf-8") as f:
        print("\n".join(extra_requirements(f.read(), extra, without)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
