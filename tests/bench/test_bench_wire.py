"""`python -m bench wire`: its refusals, its rows, and a tiny run in real network namespaces that
leaves no namespace, veth or process behind, however it ends."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import wire
from bench.__main__ import main

from needs import host_has

ROOT = Path(__file__).resolve().parents[2]
TOOLS = wire.tools()
ROOT_AND_TOOLS = host_has(
    os.geteuid() == 0 and all(name in TOOLS for name in ("ip", "tc", "nsenter")),
    "root and ip/tc (iproute2), nsenter (util-linux): network namespaces and a shaped veth",
)
TINY = ["--floats", "100000", "--repeats", "2", "--warmup", "1", "--rates", "10gbit"]


def namespaces() -> str:
    return subprocess.run([TOOLS["ip"], "netns", "list"], capture_output=True, text=True).stdout


def links() -> str:
    return subprocess.run([TOOLS["ip"], "-o", "link", "show"], capture_output=True, text=True).stdout


def children(pid: int) -> set[int]:
    """The processes whose parent is `pid`."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text()}


def test_resnet18_floats_are_torchvisions_parameter_count():
    import torchvision  # in every run mode of the project: a missing one is a failure, not a skip

    assert wire.RESNET18_FLOATS == sum(p.numel() for p in torchvision.models.resnet18().parameters())


def test_rates_parse_as_tc_reads_them():
    assert wire.rate_bits("1gbit") == 10**9
    assert wire.rate_bits("10gbit") == 10**10
    assert wire.rate_bits("500mbit") == 5 * 10**8
    assert wire.rate_bits("none") is None
    with pytest.raises(ValueError, match="not a tc rate"):
        wire.rate_bits("10G")


def test_refuses_in_one_line_with_status_2_when_not_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["wire", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs root" in err


def test_refuses_when_ip_or_tc_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(wire, "tools", lambda: {"nsenter": "/usr/bin/nsenter"})
    assert main(["wire", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs ip, tc" in err


def test_tools_are_found_off_path(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    found = wire.tools()
    assert all(os.path.dirname(path) in wire.SEARCH for path in found.values())


def test_a_row_says_what_bounds_each_path():
    app = dict(repeats=2, bytes=2 * 8_000_000, trips_s=[0.1, 0.3, 0.2], wall_s=0.2, client_cpu_s=0.12, server_cpu_s=0.1)
    app.update(client_wait_s=0.0, server_wait_s=0.0)
    raw = dict(app, trips_s=[0.04], wall_s=0.014, client_cpu_s=0.004, server_cpu_s=0.004)
    r = wire.row("10gbit", "curve", app, raw)
    assert r["ratio"] == pytest.approx(0.2)
    assert r["exchange"]["link_s"] == pytest.approx(8_000_000 * 8 / 1e10)
    assert (r["exchange"]["bound"], r["raw"]["bound"]) == ("CPU", "link")
    assert "10gbit   curve" in wire.table([r]) and "CPU" in wire.where_the_time_goes([r])
    t = dict(wall_s=1.0, client_cpu_s=0.1, server_cpu_s=0.1, client_wait_s=0.0, server_wait_s=0.3)
    assert wire.bound(t, 0.75) == "link + CPU queue" and wire.bound(dict(t, server_wait_s=0.0), 0.75) == "link + CPU"
    assert wire.bound(t, None) == "CPU queue"


@pytest.mark.slow
@ROOT_AND_TOOLS
def test_a_tiny_run_prints_a_row_per_case_and_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "wire.json"
    before = children(os.getpid())
    code = main(["wire", *TINY, "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, f"{captured.out}\n{captured.err}"
    rows = [line.split() for line in captured.out.splitlines() if line.startswith("10gbit ")]
    table = {(r[0], r[1]): float(r[4]) for r in rows if len(r) == 5}
    assert set(table) == {("10gbit", "curve"), ("10gbit", "plain")}
    assert all(ratio > 0 for ratio in table.values())
    assert "where the time goes" in captured.out
    doc = json.loads(out.read_text())
    assert doc["kind"] == "wire" and [r["case"] for r in doc["rows"]] == ["curve", "plain"]
    for r in doc["rows"]:
        assert r["rate"] == "10gbit" and r["exchange_mb_s"] > 0 and r["raw_mb_s"] > 0 and r["ratio"] > 0
        for path in ("exchange", "raw"):
            assert r[path]["wall_s"] > 0 and r[path]["client_cpu_s"] >= 0 and r[path]["bound"]
    assert "secret" not in doc["settings"]
    name = f"{wire.PREFIX}{os.getpid()}"
    assert name not in namespaces() and name not in links()
    assert alive(children(os.getpid()) - before) == set()


@pytest.mark.slow
@ROOT_AND_TOOLS
def test_a_failed_measurement_is_reported_and_cleaned_up(capsys):
    before = children(os.getpid())
    code = main(["wire", *TINY, "--cases", "curve", "--timeout", "0.2"])  # no client ends in time
    captured = capsys.readouterr()
    assert code == 1 and "did not finish within" in captured.out
    name = f"{wire.PREFIX}{os.getpid()}"
    assert name not in namespaces() and name not in links()
    assert alive(children(os.getpid()) - before) == set()


@pytest.mark.slow
@ROOT_AND_TOOLS
def test_ctrl_c_deletes_the_namespaces_and_ends_its_processes():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "bench", "wire", *TINY, "--repeats", "1000", "--timeout", "120"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    name = f"{wire.PREFIX}{proc.pid}"
    try:
        deadline, peers = time.monotonic() + 90, set()
        while time.monotonic() < deadline and len(peers) < 2:  # a server and a client running
            peers = alive(children(proc.pid))
            time.sleep(0.2)
        assert len(peers) == 2 and name in namespaces()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode()
    assert name not in namespaces() and name not in links()
    assert alive(peers) == set()
