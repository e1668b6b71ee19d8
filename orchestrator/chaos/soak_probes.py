"""What the soak does and reads inside the job's containers, standard library only.

The soak sends this file's source to `python -c` in a container (`python -c SOURCE COMMAND
ARG...`: the keeper for the state volume, the `pidns` holder for /dev/shm and the processes),
and reads the one JSON object it prints. The tests call the same functions on a directory.

    audit STATE_DIR CHECKPOINT_DIR   the PS's checkpoint files, each with whether its bytes match
                                     the digest in its name; the temporary files; final.pt
    fill PATH SECONDS                fill the free space of PATH's filesystem with PATH for SECONDS
    corrupt CHECKPOINT_DIR           flip 64 bytes in the middle of the newest checkpoint file
    shm SHM_DIR PROC_DIR             the files of SHM_DIR, and each `python -m app ROLE` process
                                     with its role, rank, shard and the SHM_DIR files it maps
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import sys
import time
from typing import Any, Optional

CHECKPOINT = re.compile(r"^ckpt-(\d+)-([0-9a-f]{16})\.pt$")  # app/checkpoint/files.py
FILL_PREFIX = ".soak-fill"


def is_temporary(name: str) -> bool:
    """A file a writer leaves only when cut short (the app's `.*.tmp`), or the soak's fill."""
    return name.endswith(".tmp") or name.startswith(FILL_PREFIX)


def audit(state_dir: str, checkpoint_dir: str) -> dict[str, Any]:
    files, temp = {}, []
    for root, _, names in os.walk(state_dir):
        temp += [os.path.join(root, n) for n in names if is_temporary(n)]
    for name in sorted(os.listdir(checkpoint_dir)) if os.path.isdir(checkpoint_dir) else []:
        m = CHECKPOINT.match(name)
        if m is None:
            continue
        try:
            with open(os.path.join(checkpoint_dir, name), "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()[:16] == m.group(2)
        except OSError:  # pruned meanwhile
            continue
    final = os.path.isfile(os.path.join(checkpoint_dir, "final.pt"))
    return {"time": time.time(), "files": files, "temp": temp, "final": final}


def fill(path: str, seconds: float) -> dict[str, Any]:
    """Write `path` until its filesystem is full, keep it `seconds`, remove it."""
    st = os.statvfs(os.path.dirname(path))
    free, written, chunk = st.f_bavail * st.f_frsize, 0, b"\0" * (1 << 20)
    try:
        with open(path, "wb", buffering=0) as f:
            for size in (1 << 20, 4096, 1):
                while True:
                    try:
                        written += f.write(chunk[:size]) or 0
                    except OSError as error:
                        if error.errno != errno.ENOSPC:
                            raise
                        break
            filled = time.time()
            time.sleep(seconds)
    finally:
        os.unlink(path)
    return {"free": free, "written": written, "filled": filled, "released": time.time()}


def corrupt(checkpoint_dir: str) -> dict[str, Any]:
    """Damage the newest checkpoint (write time, then version: the app's order); {} when none."""
    found = []
    for name in os.listdir(checkpoint_dir):
        m = CHECKPOINT.match(name)
        if m is not None:
            found.append((os.stat(os.path.join(checkpoint_dir, name)).st_mtime_ns, int(m.group(1)), name))
    if not found:
        return {}
    _, version, name = max(found)
    path = os.path.join(checkpoint_dir, name)
    middle = os.path.getsize(path) // 2
    with open(path, "r+b") as f:
        f.seek(middle)
        data = f.read(64)
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in data))
    return {"file": name, "version": version}


def _mapped(proc_dir: str, pid: str, shm_dir: str) -> list[str]:
    found = set()
    with open(os.path.join(proc_dir, pid, "maps")) as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith(shm_dir.rstrip("/") + "/"):
                found.add(fields[5].strip().removesuffix(" (deleted)"))
    return sorted(found)


def _app_process(proc_dir: str, pid: str, shm_dir: str) -> Optional[dict[str, Any]]:
    try:
        with open(os.path.join(proc_dir, pid, "cmdline"), "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    if argv[1:3] != [b"-m", b"app"] or len(argv) < 4:
        return None
    try:
        with open(os.path.join(proc_dir, pid, "environ"), "rb") as f:
            env = dict(e.split("=", 1) for e in f.read().decode("utf-8", "replace").split("\0") if "=" in e)
        maps: Optional[list[str]] = _mapped(proc_dir, pid, shm_dir)
    except OSError:  # gone meanwhile, or not ours to read
        env, maps = {}, None
    role = argv[3].decode("utf-8", "replace")
    return {
        "pid": int(pid),
        "role": role,
        "rank": env.get("PSC_RANK", ""),
        "shard": env.get("PSC_SHARD", "0"),
        "maps": maps,
    }


def shm(shm_dir: str, proc_dir: str) -> dict[str, Any]:
    procs = [p for pid in os.listdir(proc_dir) if pid.isdigit() and (p := _app_process(proc_dir, pid, shm_dir))]
    return {"files": sorted(os.listdir(shm_dir)), "procs": procs}


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "audit":
        result = audit(*args)
    elif command == "fill":
        result = fill(args[0], float(args[1]))
    elif command == "corrupt":
        result = corrupt(*args)
    elif command == "shm":
        result = shm(*args)
    else:
        print(f"soak_probes: unknown command {command!r}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
