"""kill -9 a process while it writes checkpoints, again and again (`make chaos`, tests/failure).

The writer is the PS's own checkpoint code (the app's checkpoint module) in a
child process that announces each file write, so that each kill lands inside
one. After every kill, every checkpoint file left must verify (its bytes
match the checksum in its name) and the newest must load: a crash never
leaves only a corrupt newest file. Swapping in a plain open/write for the
atomic write makes this fail.

The orchestrator stays torch-free: the writer and the checker both run the
app's code in child processes (`sys.executable`, the app's venv), and the
checker reports its findings as one JSON line.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.chaos.common import Outcome, Scenario
from orchestrator.paths import HOME
from orchestrator.verbs.local import spawn

CHECKPOINT_MODULE = "app.checkpoint.files"  # the app's checkpoint code (save, listing, verify, newest_good)

# The writer: the PS's checkpoint code, writing as fast as it can a state the size of
# a small model with its optimizer. It says when each file write begins, so that the
# kill can land inside one. argv: module, directory, megabytes.
_WRITER = """
import importlib, sys, time, torch
checkpoint = importlib.import_module(sys.argv[1])
directory, mb = sys.argv[2], int(sys.argv[3])
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

# The checker: every checkpoint file in the directory must verify. argv: module, directory.
# Prints one JSON line: the problems found (empty: every file verified).
_CHECKER = """
import importlib, json, sys
checkpoint = importlib.import_module(sys.argv[1])
directory = sys.argv[2]
files = checkpoint.listing(directory)
problems = [] if files else ["no checkpoint in %s" % directory]
for path in files:
    try:
        checkpoint.verify(path)
    except (ValueError, OSError) as error:
        problems.append("%s: %s" % (path.name, error))
print(json.dumps(problems), flush=True)
"""


def _env() -> dict[str, str]:
    return {"PYTHONPATH": str(HOME)}


def kill_loop(run_dir: Path, rounds: int = 10, mb: int = 16, seed: int = 0) -> Outcome:
    """kill -9 a process in the middle of its checkpoint writes, `rounds` times: every
    checkpoint file left verifies, and the newest is loadable."""
    out = Outcome(f"kill -9 while writing checkpoints (x{rounds})")
    directory = run_dir / "checkpoints"
    rng = random.Random(seed)
    mid_write, problems = 0, []
    for _ in range(rounds):
        p = spawn(
            [sys.executable, "-c", _WRITER, CHECKPOINT_MODULE, str(directory), str(mb)],
            _env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert p.stdout is not None
        try:
            p.stdout.readline()
            took = p.stdout.readline().decode().split()  # one whole write, timed
            if not took or p.stdout.readline() != b"write\n":
                problems.append("the writer stopped before its second write")
                break
            time.sleep(rng.uniform(0.0, 1.0) * float(took[1]))  # into the write that just began
            p.kill()
        finally:
            p.kill()
            p.wait(timeout=30)
        mid_write += bool(list(directory.glob(".*.tmp")))
        problems += check_checkpoints(directory)
        for tmp in directory.glob(".*.tmp"):  # what the next PS start does
            tmp.unlink()
    out.recovered = not problems
    out.details.update(mid_write=mid_write, problems=problems)
    out.notes = f"{mid_write}/{rounds} kills hit a write in progress; " + (
        "every newest checkpoint verified" if not problems else "; ".join(problems[:3])
    )
    return out


def check_checkpoints(directory: Path) -> list[str]:
    """What is wrong with the checkpoint files in `directory` (empty: every one verifies),
    checked by the app's own code in a child process."""
    r = subprocess.run(
        [sys.executable, "-c", _CHECKER, CHECKPOINT_MODULE, str(directory)],
        env={**os.environ, **_env()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"the checkpoint checker exited {r.returncode}: {last}"]
    return list(json.loads(lines[-1]))


SCENARIOS: dict[str, Scenario] = {"checkpoint-kill": kill_loop}
