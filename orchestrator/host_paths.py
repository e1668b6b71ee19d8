"""Host paths a topology names besides the data: `code` and `train.init_weights`.

The render is pure, so these checks run before it writes anything (`render`,
`up`, `stack-up`, `local`). A relative path is taken from `base`: the directory
you run from (the repository root for `make`), as compose and `local` read it.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.topology.model import Topology, TopologyError


def resolve(path: str, base: Path) -> Path:
    """`path` on this host: absolute, ~-expanded, or under `base`."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


def module_files(entry_point: str) -> tuple[str, str]:
    """Where `pkg.mod:factory`'s module may live inside `code`: pkg/mod.py or pkg/mod/__init__.py."""
    parts = entry_point.split(":", 1)[0].split(".")
    stem = "/".join(parts)
    return f"{stem}.py", f"{stem}/__init__.py"


def check_paths(t: Topology, source: str, base: Path) -> None:
    """TopologyError (one line: field, value, what is allowed) for a missing `code`
    directory, an entry point's module not in it, or a missing init_weights file."""
    if t.code is not None:
        code = resolve(t.code, base)
        if not code.is_dir():
            what = "is a file" if code.exists() else "does not exist"
            raise TopologyError(
                source,
                "code",
                f"got {t.code!r}; must be a directory of Python code on this host (it {what}, from {base})",
            )
        for field, value in t.entry_points():
            candidates = module_files(value)
            if not any((code / c).is_file() for c in candidates):
                raise TopologyError(
                    source, field, f"got {value!r}; its module must be in code {t.code!r} as {' or '.join(candidates)}"
                )
    weights = t.train.init_weights
    if weights is not None and not resolve(weights, base).is_file():
        raise TopologyError(
            source,
            "train.init_weights",
            f"got {weights!r}; must be a state dict file on this host (no such file, from {base})",
        )
