"""What the soak runs inside the containers (orchestrator/chaos/soak_probes.py), on real files:
the checkpoint audit, the damage it does to the newest checkpoint, the /dev/shm snapshot, and
the `python -c SOURCE COMMAND ARG...` form the soak sends it in."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from orchestrator.chaos import soak_probes
from orchestrator.chaos.soak_job import PROBES


def checkpoint(directory: Path, version: int, data: bytes, mtime: int) -> str:
    """A checkpoint file as the app names it: its version and the digest of its bytes."""
    name = f"ckpt-{version:08d}-{hashlib.sha256(data).hexdigest()[:16]}.pt"
    (directory / name).write_bytes(data)
    os.utime(directory / name, ns=(mtime, mtime))
    return name


def state_dir(tmp_path: Path) -> tuple[Path, list[str]]:
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "shard1").mkdir(parents=True)
    names = [checkpoint(checkpoints, v, bytes([v % 251]) * 4096, 10**18 + v) for v in (200, 400, 600)]
    return checkpoints, names


def test_the_audit_checks_each_checkpoint_s_bytes_against_its_name_and_finds_temp_files(tmp_path):
    checkpoints, names = state_dir(tmp_path)
    (checkpoints / f".{names[0]}.12.tmp").write_bytes(b"cut short")
    (checkpoints / "shard1" / ".ckpt-00000400-0123456789abcdef.pt.13.tmp").write_bytes(b"")
    (checkpoints / "final.pt").write_bytes(b"model")
    (checkpoints / "ckpt-00000800-0123456789abcdef.pt").write_bytes(b"not what its name says")

    found = soak_probes.audit(str(tmp_path), str(checkpoints))

    assert found["files"] == {**dict.fromkeys(names, True), "ckpt-00000800-0123456789abcdef.pt": False}
    assert sorted(Path(p).name for p in found["temp"]) == sorted(
        [".ckpt-00000400-0123456789abcdef.pt.13.tmp", f".{names[0]}.12.tmp"]
    )
    assert found["final"] is True


def test_corrupt_damages_the_newest_checkpoint_by_write_time_and_the_audit_sees_it(tmp_path):
    checkpoints, names = state_dir(tmp_path)
    os.utime(checkpoints / names[0], ns=(2 * 10**18, 2 * 10**18))  # version 200 written last (a resume)
    size = (checkpoints / names[0]).stat().st_size

    damaged = soak_probes.corrupt(str(checkpoints))

    assert damaged == {"file": names[0], "version": 200}
    assert (checkpoints / names[0]).stat().st_size == size  # damaged in place, not truncated
    assert soak_probes.audit(str(tmp_path), str(checkpoints))["files"] == {
        names[0]: False,
        names[1]: True,
        names[2]: True,
    }
    assert soak_probes.corrupt(str(tmp_path / "checkpoints" / "shard1")) == {}


def fake_process(proc: Path, pid: int, argv: list[str], env: dict[str, str], maps: list[str]) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    lines = [f"7f00000{i}000-7f00000{i}fff rw-s 00000000 00:2a 1234 {m}\n" for i, m in enumerate(maps)]
    (d / "maps").write_text("7f0000000000-7f0000001000 r-xp 00000000 08:01 99 /usr/bin/python3.11\n" + "".join(lines))


def test_the_shm_snapshot_lists_the_app_processes_with_their_service_and_segments(tmp_path):
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    (shm / "psc-10-aa.shm").write_bytes(b"")
    fake_process(proc, 10, ["python", "-m", "app", "ps"], {"PSC_RANK": "0"}, ["/dev/shm/psc-10-aa.shm"])
    fake_process(proc, 11, ["python", "-m", "app", "ps"], {"PSC_SHARD": "1"}, [])
    fake_process(proc, 12, ["python", "-m", "app", "worker"], {"PSC_RANK": "2"}, ["/dev/shm/psc-10-aa.shm (deleted)"])
    fake_process(proc, 13, ["python", "-m", "app.pidns"], {}, [])  # the holder's loop: not the app
    (proc / "self").mkdir()

    found = soak_probes.shm(str(shm), str(proc))

    assert found["files"] == ["psc-10-aa.shm"]
    by_pid = {p["pid"]: p for p in found["procs"]}
    assert set(by_pid) == {10, 11, 12}
    assert by_pid[10] == {"pid": 10, "role": "ps", "rank": "0", "shard": "0", "maps": []}  # maps under /dev/shm only
    assert by_pid[11]["shard"] == "1" and by_pid[12]["rank"] == "2"


def test_the_shm_snapshot_keeps_the_segments_mapped_from_the_shm_dir(tmp_path):
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    fake_process(proc, 12, ["python", "-m", "app", "worker"], {"PSC_RANK": "1"}, [f"{shm}/psc-10-aa.shm (deleted)"])
    assert soak_probes.shm(str(shm), str(proc))["procs"][0]["maps"] == [f"{shm}/psc-10-aa.shm"]


def test_the_probes_run_as_the_soak_sends_them_one_json_object_out(tmp_path):
    checkpoints, names = state_dir(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", PROBES, "audit", str(tmp_path), str(checkpoints)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout)["files"] == dict.fromkeys(names, True)
    bad = subprocess.run([sys.executable, "-c", PROBES, "nothing"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'nothing'" in bad.stderr
