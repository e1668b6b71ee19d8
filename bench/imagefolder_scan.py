"""`python -m bench scan [--files N] [--classes C]`: how long the ImageFolder scan of
N tiny files takes (app.data.imagefolder.find_samples), on a tree generated in a temp dir.

The files are empty `.jpg` names: the scan lists directories and never opens a file,
so their content does not matter. Creating the tree takes longer than scanning it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path


def make_tree(root: Path, files: int, classes: int, subdirs: int = 4) -> None:
    """`files` empty .jpg files in `classes` class folders, each split over `subdirs` subfolders."""
    for i in range(files):
        c, s = i % classes, (i // classes) % subdirs
        folder = root / f"class{c:03d}" / f"part{s}"
        if i < classes * subdirs:
            folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img{i:07d}.jpg").touch()


def scan_seconds(root: Path) -> tuple[float, int]:
    """(seconds, samples found) of one find_samples over `root`, page cache warm."""
    from app.data.imagefolder import find_samples

    start = time.perf_counter()
    _, samples = find_samples(root)
    return time.perf_counter() - start, len(samples)


def main(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="psc-scan-"))
    try:
        start = time.perf_counter()
        make_tree(tmp, args.files, args.classes)
        made = time.perf_counter() - start
        times = []
        for _ in range(args.repeats):
            seconds, found = scan_seconds(tmp)
            times.append(seconds)
        assert found == args.files, (found, args.files)
        print(
            f"scan: {found} files in {args.classes} classes ({made:.1f} s to create): "
            f"find_samples {min(times):.2f} s (best of {args.repeats}; {found / min(times):,.0f} files/s) "
            f"on {os.cpu_count()} CPU(s)"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scan", help="time the ImageFolder scan of a generated tree of tiny files")
    p.add_argument("--files", type=int, default=100_000, help="files in the tree (default %(default)s)")
    p.add_argument("--classes", type=int, default=100, help="class folders (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
