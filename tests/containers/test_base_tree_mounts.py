"""The offline base build's tree and what debootstrap may leave mounted in it
(images/tree-mounts.sh): a /proc left mounted in the tree was walked, tarred into the
image's import and failed the build. Real mounts, as the build makes them (root, as the
build itself needs); under CI=true a host without root fails the test, never skips it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.paths import ROOT

from needs import unavailable

pytestmark = pytest.mark.slow

HELPERS = ROOT / "images" / "tree-mounts.sh"


def helpers(tree: Path, call: str) -> subprocess.CompletedProcess:
    script = f'ROOTFS="{tree}"; . "{HELPERS}"; {call}'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


def mounts_below(path: Path) -> list[str]:
    return [
        line.split()[1]
        for line in Path("/proc/mounts").read_text().splitlines()
        if line.split()[1].startswith(f"{path}/")
    ]


@pytest.fixture
def root_user() -> None:
    if os.geteuid() != 0:
        unavailable("the base build's tree mounts need root (mount, umount)")


def test_the_tree_is_removed_with_what_was_left_mounted_in_it_and_nothing_beyond(root_user, tmp_path: Path):
    tree, outside = tmp_path / "rootfs", tmp_path / "host-dir"
    (tree / "proc").mkdir(parents=True)
    (tree / "mnt" / "host").mkdir(parents=True)
    (tree / "usr" / "bin").mkdir(parents=True)
    (tree / "usr" / "bin" / "python3").write_text("")
    outside.mkdir()
    (outside / "keep.txt").write_text("the host's")
    subprocess.run(["mount", "-t", "proc", "proc", str(tree / "proc")], check=True)
    subprocess.run(["mount", "--bind", str(outside), str(tree / "mnt" / "host")], check=True)
    try:
        assert helpers(tree, "mounted_below").stdout.split() == sorted(mounts_below(tree), reverse=True)
        left = sorted(mounts_below(tree), reverse=True)
        assert len(left) == 2
        done = helpers(tree, "remove_tree")
        assert done.returncode == 0, done.stderr
        assert done.stderr.splitlines() == [f"tree-mounts: {m} was still mounted; unmounted" for m in left]
        assert mounts_below(tree) == [] and not tree.exists()
        assert (outside / "keep.txt").read_text() == "the host's"  # a bind mount's files are the host's: kept
    finally:
        for m in sorted(mounts_below(tree), reverse=True):
            subprocess.run(["umount", "-l", m], check=False)


def test_an_empty_tree_or_none_is_removed_quietly(root_user, tmp_path: Path):
    tree = tmp_path / "rootfs"
    assert helpers(tree, "remove_tree").returncode == 0  # none yet (the build's first step)
    (tree / "etc").mkdir(parents=True)
    assert helpers(tree, "unmount_tree && remove_tree").returncode == 0 and not tree.exists()
