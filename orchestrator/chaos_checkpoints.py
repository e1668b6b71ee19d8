"""kill -9 a process while it writes checkpoints, again and again (`make chaos`, tests/failure).

The writer is the PS's own checkpoint code (app.common.checkpoint.save) in a child
process that announces each file write, so that each kill lands inside one.
After every kill, every checkpoint file left must verify (its bytes match the
checksum in its name) and the newest must load: a crash never leaves only a
corrupt newest file. Swapping in a plain open/write for the atomic write makes
this fail (checked by hand).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.chaos import Outcome

# The writer of `checkpoint_kill_loop`: the PS's own checkpoint code, writing as
# fast as it can a state the size of a small model with its optimizer. It says
# when each file write begins, so that the kill can land inside one.
_WRITER = """
import sys, time, torch
from app.common import checkpoint
directory, mb = sys.argv[1], int(sys.argv[2])
write = checkpoint.write_atomically
def announced(data, path):
    t = time.monotonic()
    print("write", flush=True)
    write(data, path)
    print("took %.4f" % (time.monotonic() - t), flush=True)
checkpoint.write_atomically = announced
found = checkpoint.newest_good(directory)
version = found[1]["version"] if found else 0
state = {"model": {"w": torch.randn(mb * 262144)}, "optimizer": {}, "progress": {}, "finished": False}
while True:
    version += 1
    checkpoint.save(dict(state, version=version), directory)
"""


def kill_loop(run_dir: Path, rounds: int = 10, mb: int = 16, seed: int = 0) -> Outcome:
    """kill -9 a process in the middle of its checkpoint writes, `rounds` times: every
    checkpoint file left verifies, and the newest is loadable."""
    out = Outcome(f"kill -9 while writing checkpoints (x{rounds})", False, None, None, None)
    directory = run_dir / "checkpoints"
    rng = random.Random(seed)
    mid_write, problems = 0, []
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for _ in range(rounds):
        p = subprocess.Popen([sys.executable, "-c", _WRITER, str(directory), str(mb)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            p.stdout.readline()
            took = p.stdout.readline().split()  # one whole write, timed
            if not took or p.stdout.readline() != "write\n":
                problems.append("the writer stopped before its second write")
                break
            time.sleep(rng.uniform(0.0, 1.0) * float(took[1]))  # into the write that just began
            p.kill()
        finally:
            p.kill()
            p.wait(timeout=30)
        mid_write += bool(list(directory.glob(".*.tmp")))
        problems += _check_checkpoints(directory)
        for tmp in directory.glob(".*.tmp"):  # what the next PS start does
            tmp.unlink()
    out.recovered = not problems
    out.details.update(mid_write=mid_write, problems=problems)
    out.notes = f"{mid_write}/{rounds} kills hit a write in progress; " + (
        "every newest checkpoint verified" if not problems else "; ".join(problems[:3]))
    return out


def _check_checkpoints(directory: Path) -> list[str]:
    from app.common import checkpoint  # torch: only for this scenario

    files = checkpoint.listing(directory)
    if not files:
        return [f"no checkpoint in {directory}"]
    bad = []
    for path in files:
        try:
            checkpoint.verify(path)
        except (ValueError, OSError) as error:
            bad.append(f"{path.name}: {error}")
    return bad
