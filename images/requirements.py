"""Read the lock files (requirements/*.txt, written by `make lock`): what each pins,
and the blocks (a pin with its hashes) to give `pip install --require-hashes --no-deps`.

Used on the host (images/wheelhouse.sh, the tests) and inside the image build, where
only the standard library is there:

    python images/requirements.py LOCK [--without OTHER_LOCK]   # LOCK's blocks, less OTHER_LOCK's packages
    python images/requirements.py LOCK --not-installed          # LOCK's blocks for packages not installed here
    python images/requirements.py LOCK --check-pair BASE        # one warning unless torch + torchvision are LOCK's
    python images/requirements.py LOCK --differences            # one line per installed package not at LOCK's version
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from typing import NamedTuple

PAIR = ("torch", "torchvision")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")
_HASH = re.compile(r"--hash=(\w+:[0-9a-fA-F]+)")


class Pin(NamedTuple):
    name: str  # normalised (PEP 503)
    version: str
    hashes: tuple[str, ...]
    block: str  # the pin and its hashes, as pip reads them


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    """The version without its local label: 2.14.1+cu130 -> 2.14.1."""
    return version.split("+", 1)[0]


def parse(text: str) -> dict[str, Pin]:
    """Every `name==version` of a lock file with the `--hash=` lines that follow it."""
    pins: dict[str, Pin] = {}
    name = version = ""
    hashes: list[str] = []

    def close() -> None:
        if name:
            lines = [f"{name}=={version}", *(f"    --hash={h}" for h in hashes)]
            pins[normalize(name)] = Pin(normalize(name), version, tuple(hashes), " \\\n".join(lines) + "\n")

    for line in text.splitlines():
        stripped = line.split("#", 1)[0].strip() if not line.lstrip().startswith("--hash") else line.strip()
        if not stripped:
            continue
        if not line[:1].isspace():
            close()
            m = _PIN.match(stripped)
            name, version, hashes = (m.group(1), m.group(2), []) if m else ("", "", [])
        else:
            hashes.extend(_HASH.findall(stripped))
    close()
    return pins


def read(path: str) -> dict[str, Pin]:
    with open(path, encoding="utf-8") as f:
        return parse(f.read())


def installed() -> dict[str, str]:
    """The distributions this interpreter sees: normalised name -> version."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize(name), dist.version)
    return found


def pair_mismatch(pins: dict[str, Pin], have: dict[str, str]) -> list[str]:
    """`torch <version> (the lock: <version>)` for each of the pair not at the lock's version (local labels aside)."""
    return [
        f"{name} {have.get(name, 'missing')} (the lock: {pins[name].version})"
        for name in PAIR
        if name in pins and public(have.get(name, "")) != public(pins[name].version)
    ]


def main(argv: list[str]) -> int:
    path, *rest = argv
    pins = read(path)
    if rest[:1] == ["--without"]:
        other = read(rest[1])
        sys.stdout.write("".join(p.block for n, p in pins.items() if n not in other))
    elif rest[:1] == ["--not-installed"]:
        have = installed()
        sys.stdout.write("".join(p.block for n, p in pins.items() if n not in have))
    elif rest[:1] == ["--check-pair"]:
        wrong = pair_mismatch(pins, installed())
        if wrong:
            print(
                f"warning: the base image {rest[1]} has {', '.join(wrong)}: kept, and the app runs on it, but "
                "it is tested with the pair of images/torch-pair.txt (the Dockerfile's default base has it)",
                file=sys.stderr,
            )
    elif rest[:1] == ["--differences"]:
        have = installed()
        for n, p in pins.items():
            if n in have and have[n] != p.version and not ("+" not in p.version and public(have[n]) == p.version):
                print(f"note: the base's {n} {have[n]} is kept (the lock: {p.version})")
    else:
        sys.stdout.write("".join(p.block for p in pins.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
