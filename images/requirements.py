"""Print one extra's requirements from pyproject.toml, one per line.

Used on the host (images/wheelhouse.sh) and inside the image build, so the
dependency layer is built from pyproject.toml alone, before the app's code is
copied: editing app/ does not reinstall torch.

    python images/requirements.py pyproject.toml app
"""

import sys

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # older Pythons: pip vendors the same parser
    from pip._vendor import tomli as tomllib


def extra_requirements(pyproject_text: str, extra: str) -> list[str]:
    """The requirement strings of `[project.optional-dependencies].<extra>`."""
    project = tomllib.loads(pyproject_text)["project"]
    return list(project.get("dependencies", [])) + list(project["optional-dependencies"][extra])


def main(argv: list[str]) -> int:
    path, extra = argv
    with open(path, encoding="utf-8") as f:
        print("\n".join(extra_requirements(f.read(), extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
