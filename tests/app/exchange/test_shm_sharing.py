"""Processes that share one /dev/shm (local processes; the workers of one compose project,
which share an IPC namespace) and `image_cache: auto`: each chooses with the room the others
have reserved already, so together they never take more than auto allows, and none fails.

Each process runs in one private mount namespace (`unshare`; a user namespace when not root)
whose /dev/shm is a small tmpfs. They failed before the fix: every process measured the same
free /dev/shm before any had reserved its cache, so more of them chose memory than fit, and
one failed reserving it (exit 2: `cannot reserve ... in /dev/shm`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from app_testkit import REPO, app_env
from needs import unavailable

SHM_MB = 48
PROCESSES = 4
PER_SHARD = 100  # images of each process's shard; 224 px crops cached at 256 px: 19.2 MB a shard

# Each process: wait for the start file (all start together), load its shard with auto, say
# what it chose, and hold its reservation until every process has chosen (the stop file).
ONE = """
import logging, os, sys, time
from app.data import datasets
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
root, start, stop, index, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
print("ready", flush=True)
while not os.path.exists(start):
    time.sleep(0.0005)
try:
    got = datasets.load("imagefolder", root, "train", 0, 224, "auto", shard=(index, count))
except Exception as error:
    print("chose failed:", error, flush=True)
    sys.exit(2)
print("chose", "memory" if type(got.data).__name__ == "CachedImageFolder" else "off", flush=True)
while not os.path.exists(stop):
    time.sleep(0.01)
"""

# A process of the same protocol that is choosing now: it holds the /dev/shm lock as the app
# does while it measures and reserves, but reserves only once every other process has either
# chosen (they did not wait for it) or said that it waits for the lock.
HOLDER = """
import os, sys, time
from pathlib import Path
from app.data import imagecache, store
from app.data.datasets import stable_shard
from app.data.imagefolder import find_samples
root, start, stop, index, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
out = Path(start).parent / "out"
samples = find_samples(Path(root) / "train")[1]
mine = [samples[i] for i in stable_shard(len(samples), count, index)]
with store.shm_choice("auto"):
    print("ready", flush=True)
    others = [out / f"p{i}.out" for i in range(1, count)]
    while not all("chose" in p.read_text() or "waiting for it" in p.read_text() for p in others):
        time.sleep(0.01)
    cache = imagecache.CachedImageFolder(mine, train=True)  # 19.2 MB of /dev/shm, reserved now
print("chose memory", flush=True)
while not os.path.exists(stop):
    time.sleep(0.01)
"""

# The processes, started in one mount namespace with a small /dev/shm; the test releases
# them with the start file and ends them with the stop file once each has said its choice.
# {first}: the program of process 0 (ONE, or HOLDER).
GROUP = """
set -e
mount -t tmpfs -o size={shm}m tmpfs /dev/shm
for i in $(seq 0 {last}); do
    program="$ONE"
    [ "$i" = 0 ] && program="${first}"
    "{python}" -c "$program" "{root}" "{start}" "{stop}" "$i" {count} > "{out}/p$i.out" 2>&1 &
done
wait
ls -A /dev/shm > "{out}/left-in-shm"
"""


def _tree(root: Path) -> Path:
    for c in range(2):
        (root / "train" / f"c{c}").mkdir(parents=True)
        (root / "val" / f"c{c}").mkdir(parents=True)
        Image.new("RGB", (8, 8), (c * 200, 0, 0)).save(root / "val" / f"c{c}" / "0.png")
        for i in range(PER_SHARD * PROCESSES // 2):
            Image.new("RGB", (8, 8), (c * 200, i % 256, 0)).save(root / "train" / f"c{c}" / f"{i:03d}.png")
    return root


def _namespace() -> list[str]:
    """`unshare` into a private mount namespace (with a user namespace when not root)."""
    if shutil.which("unshare") is None:
        unavailable("no unshare(1) to give the processes a /dev/shm of their own")
    return ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]


def _run_group(tmp_path: Path, first: str) -> tuple[dict[str, str], Path]:
    """Start the processes (process 0 runs `first`) in their namespace, release them
    together, and return each one's choice once all have chosen, and their output folder."""
    root = _tree(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    start, stop = tmp_path / "start", tmp_path / "stop"
    script = GROUP.format(
        shm=SHM_MB,
        last=PROCESSES - 1,
        first=first,
        python=sys.executable,
        root=root,
        start=start,
        stop=stop,
        count=PROCESSES,
        out=out,
    )
    group = subprocess.Popen([*_namespace(), "sh", "-c", script], env=app_env(ONE=ONE, HOLDER=HOLDER), cwd=REPO)
    try:
        chosen = _choices(out, start, group)
    finally:
        stop.touch()
        group.wait(timeout=60)
    assert group.returncode == 0, {p.name: p.read_text()[-500:] for p in out.glob("*.out")}
    assert (out / "left-in-shm").read_text() == ""  # the lock file goes with its last holder
    return chosen, out


@pytest.mark.slow
def test_auto_on_a_shared_dev_shm_takes_the_others_reservations_into_account(tmp_path):
    """A 48 MB /dev/shm and four 19.2 MB shards, the four processes started together: the
    first to choose takes memory (19.2 MB is at most half of 48); after it 28.8 MB are free
    and 19.2 MB is more than half: the other three choose off. Every process exits 0."""
    chosen, _ = _run_group(tmp_path, "ONE")
    assert sorted(chosen.values()) == ["memory", "off", "off", "off"], chosen


@pytest.mark.slow
def test_a_process_choosing_auto_waits_for_the_one_that_is_reserving(tmp_path):
    """Process 0 is choosing (it holds the lock) and reserves its 19.2 MB only after the
    others have come to choose: they wait for it, then see 28.8 MB free and choose off.
    Before the fix they did not wait: the first saw 48 MB free and took memory too."""
    chosen, out = _run_group(tmp_path, "HOLDER")
    assert chosen == {"p0": "memory", "p1": "off", "p2": "off", "p3": "off"}, chosen
    for i in range(1, PROCESSES):
        assert "another process is choosing its image cache on this /dev/shm" in (out / f"p{i}.out").read_text()


def _lines(out: Path, first: str) -> dict[str, str]:
    """Each process's first output line starting with `first` (what follows it)."""
    found = {}
    for p in out.glob("p*.out"):
        lines = [line for line in p.read_text().splitlines() if line.startswith(first)]
        if lines:
            found[p.stem] = lines[0][len(first) :].strip()
    return found


def _choices(out: Path, start: Path, group: subprocess.Popen) -> dict[str, str]:
    """Wait until every process is ready (torch imported, waiting for the start file), start
    them together, then collect each one's choice."""
    import time

    deadline = time.monotonic() + 120
    for first, then in (("ready", start.touch), ("chose", None)):
        while len(_lines(out, first)) < PROCESSES:
            assert group.poll() is None, {p.name: p.read_text()[-500:] for p in out.glob("*.out")}
            assert time.monotonic() < deadline, f"not every process said {first!r} within 120 s"
            time.sleep(0.05)
        if then is not None:
            then()
    return _lines(out, "chose")
