"""A rendered document as YAML text, and the atomic write every rendered file goes through.

`yaml_text` depends only on the document (same document, same bytes).
`write_atomic` and `write_if_changed` are the only functions under render/
that touch the disk.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    """Block style, no anchors/aliases (a value used twice is written twice)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    # Short lists of scalars on one line: `command: [ps]`, `capabilities: [gpu]`.
    flow = all(isinstance(x, (str, int, float, bool)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    # Quote "1000:1000" and the like: YAML 1.1 readers may take a:b for a number.
    style = '"' if ":" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(list, _list)
_Dumper.add_representer(str, _str)


def yaml_text(doc: dict[str, Any]) -> str:
    """`doc` as block-style YAML, keys in document order (no header)."""
    return yaml.dump(
        doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000, indent=2
    )


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (temp file + rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_if_changed(path: Path, text: str) -> bool:
    """Write `text` to `path` (making its directory) unless it already holds exactly that; True if written."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    return True
