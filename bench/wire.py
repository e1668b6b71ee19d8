"""`python -m bench wire [--rates 1gbit,10gbit] [--floats N] [--repeats N] [--quick] [--json FILE]`:
how close the job's exchange comes to the raw link between two hosts (root; `ip`, `tc`, `nsenter`).

Two network namespaces joined by a veth pair stand for two hosts; `tc` shapes both ends of the
link (a token bucket at each rate of --rates). In one namespace a PS-like server, in the other a
worker-like client (bench/wire_peer.py): the client pushes ResNet-18's parameters (11.7 M float32,
46.8 MB) through the job's own transport (app.exchange: codec + ZeroMQ) and pulls as many back,
--repeats times after --warmup; encrypted (CURVE) and authenticated only (PLAIN, `--encrypt
false`). Beside each, the raw link: a plain TCP stream of the same bytes both ways, as many times,
on the same link. Each row: bytes both ways / the median round trip of both, and their ratio;
then where the time of a round trip goes: its wall time, the link's floor (the bytes at the
shaped rate), each side's CPU (every thread), and how long their threads waited for a core
(ready to run while the cores ran other threads); the largest of the floor, the CPU and the
wait says whether the link or CPU bounds it (`bound`).

The namespaces and the veth are deleted however the run ends (an error, Ctrl-C, SIGTERM), its
processes ended; they die with it even when it is killed (PR_SET_PDEATHSIG); a later run deletes
what a killed one left. Nothing is written to /dev/shm.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from bench import harness

RESNET18_FLOATS = 11_689_512  # sum(p.numel() for p in torchvision.models.resnet18().parameters())
CASES = {"curve": True, "plain": False}  # case -> --encrypt
PREFIX = "pscw"  # + this process's id: its namespaces and veth ends (+ "s": the server's, "c": the client's)
ADDRESSES = {"s": "10.231.0.1", "c": "10.231.0.2"}
PORTS = {"app": 6231, "raw": 6232}
SEARCH = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")  # where root's tools live when they are off PATH
UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
TBF_LATENCY = "20ms"
ROOT = Path(__file__).resolve().parent.parent
PR_SET_PDEATHSIG = 1


class LinkFailed(RuntimeError):
    pass


def add_parser(sub: Any) -> None:
    p = sub.add_parser("wire", help="the job's exchange against the raw link between two namespaces (root)")
    p.add_argument("--rates", default="1gbit,10gbit", help="comma-separated tc rates (none: unshaped): %(default)s")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: %(default)s (encrypted, or not)")
    p.add_argument("--floats", type=int, default=RESNET18_FLOATS, help="float32 values each way (ResNet-18's)")
    p.add_argument("--repeats", type=int, default=10, help="timed round trips per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed round trips first")
    p.add_argument("--quick", action="store_true", help="3 timed round trips after 1, one rate (10gbit)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    p.add_argument("--json", metavar="FILE", help="write the rows and settings here")


# What the run needs.


def tools() -> dict[str, str]:
    """ip, tc and nsenter: on PATH, or in the system directories a user's PATH may leave out."""
    found = {}
    for name in ("ip", "tc", "nsenter"):
        where = shutil.which(name) or shutil.which(name, path=os.pathsep.join(SEARCH))
        if where:
            found[name] = where
    return found


def refusal(found: dict[str, str]) -> str | None:
    """Why the run cannot start, as one line; None when it can."""
    if os.geteuid() != 0:
        return "needs root (it makes network namespaces and shapes their link with tc): run it as root"
    missing = [name for name in ("ip", "tc", "nsenter") if name not in found]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux), found neither on PATH nor in {', '.join(SEARCH)}"
    return None


def rate_bits(text: str) -> int | None:
    """A tc rate in bits/s ("10gbit" -> 10**10); None for "none" (the link unshaped)."""
    if text == "none":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?bit)", text.strip().lower())
    if not match:
        raise ValueError(f"--rates: {text!r} is not a tc rate such as 1gbit, 500mbit, or none")
    return int(float(match.group(1)) * UNITS[match.group(2)])


# The link.


class Link:
    """Two namespaces, `PREFIX<pid>s` (the server) and `...c` (the client), a veth pair between them."""

    def __init__(self, found: dict[str, str]) -> None:
        self.tools = found
        self.name = f"{PREFIX}{os.getpid()}"
        self.made: list[str] = []

    def ns(self, side: str) -> str:
        return f"{self.name}{side}"

    def _ip(self, *argv: str, check: bool = True) -> None:
        done = subprocess.run([self.tools["ip"], *argv], capture_output=True, text=True)
        if check and done.returncode != 0:
            raise LinkFailed(f"ip {' '.join(argv)}: {done.stderr.strip()}")

    def up(self) -> None:
        for side in ADDRESSES:
            self._ip("netns", "add", self.ns(side))
            self.made.append(self.ns(side))
        s, c = self.ns("s"), self.ns("c")
        self._ip("link", "add", s, "netns", s, "type", "veth", "peer", "name", c, "netns", c)
        for side, address in ADDRESSES.items():
            self._ip("-n", self.ns(side), "addr", "add", f"{address}/30", "dev", self.ns(side))
            self._ip("-n", self.ns(side), "link", "set", self.ns(side), "up")
            self._ip("-n", self.ns(side), "link", "set", "lo", "up")

    def shape(self, rate: str) -> None:
        """Both ends' egress at `rate` (a token bucket), or unshaped for "none"."""
        bits = rate_bits(rate)
        for side in ADDRESSES:
            base = [self.tools["tc"], "-n", self.ns(side), "qdisc"]
            subprocess.run([*base, "del", "dev", self.ns(side), "root"], capture_output=True)
            if bits is None:
                continue
            burst = max(64 * 1024, bits // 8 // 1000)  # a millisecond's bytes
            argv = [*base, "add", "dev", self.ns(side), "root", "tbf", "rate", rate]
            done = subprocess.run([*argv, "burst", str(burst), "latency", TBF_LATENCY], capture_output=True, text=True)
            if done.returncode != 0:
                raise LinkFailed(f"tc qdisc add ... tbf rate {rate}: {done.stderr.strip()}")

    def down(self) -> None:
        """Both namespaces gone (each takes its veth end, and the pair goes with it)."""
        for name in reversed(self.made):
            self._ip("netns", "del", name, check=False)
        self._ip("link", "del", self.ns("s"), check=False)  # had it been made outside a namespace
        self.made.clear()

    def stale(self) -> None:
        """Delete the namespaces a killed run of this bench left (their process is gone)."""
        listed = subprocess.run([self.tools["ip"], "netns", "list"], capture_output=True, text=True).stdout
        for name in re.findall(rf"^({PREFIX}(\d+)[sc])\b", listed, re.MULTILINE):
            if int(name[1]) == os.getpid() or not Path(f"/proc/{name[1]}").exists():
                self._ip("netns", "del", name[0], check=False)


# The processes.


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Peers:
    """The bench's processes, each in a namespace; all ended by `end` (SIGTERM, then SIGKILL)."""

    def __init__(self, link: Link, tmp: str) -> None:
        self.link, self.tmp = link, tmp
        self.running: list[subprocess.Popen[bytes]] = []

    def start(self, side: str, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        command = [self.link.tools["nsenter"], f"--net=/run/netns/{self.link.ns(side)}"]
        command += [sys.executable, "-m", "bench.wire_peer", *argv]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=harness.python_path(ROOT))
        with open(os.path.join(self.tmp, log), "wb") as err:
            proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=ROOT,
                preexec_fn=_die_with_parent,
            )
        self.running.append(proc)
        return proc

    def log_tail(self, log: str) -> str:
        try:
            lines = Path(self.tmp, log).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-3:])

    def end(self, proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if proc in self.running:
            self.running.remove(proc)

    def end_all(self) -> None:
        for proc in list(self.running):
            self.end(proc, grace=2.0)


def measure(peers: Peers, path: str, case: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement: a server, then a client timing --repeats round trips; the client's figures."""
    common = ["--port", str(PORTS[path]), "--floats", str(args.floats)]
    if path == "app":
        common += ["--secret", args.secret] + (["--encrypt"] if CASES[case] else [])
    label = f"{path}-{case}"
    server = peers.start("s", ["server", path, *common], f"{label}.server.log")
    client_argv = ["client", path, "--addr", ADDRESSES["s"], *common]
    client = peers.start(
        "c", [*client_argv, "--repeats", str(args.repeats), "--warmup", str(args.warmup)], f"{label}.client.log"
    )
    try:
        try:
            out, _ = client.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{path} did not finish within {args.timeout:.0f} s") from None
        if client.returncode != 0:
            why = peers.log_tail(f"{label}.client.log") or peers.log_tail(f"{label}.server.log")
            raise RuntimeError(f"the {path} client exited {client.returncode}: {why}")
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            pass  # ended below
        return dict(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        peers.end(client)
        peers.end(server)


# The figures.


def row(rate: str, case: str, app: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """A rate and case's row: throughputs (MB/s: 10**6 bytes both ways over the median round
    trip), their ratio, and where the time of a round trip goes on each path (means over the
    repeats)."""
    per_trip = app["bytes"] // app["repeats"]
    r: dict[str, Any] = dict(rate=rate, case=case, repeats=app["repeats"], bytes_per_round_trip=per_trip)
    r["exchange_mb_s"] = per_trip / statistics.median(app["trips_s"]) / 1e6
    r["raw_mb_s"] = per_trip / statistics.median(raw["trips_s"]) / 1e6
    r["ratio"] = r["exchange_mb_s"] / r["raw_mb_s"]
    bits = rate_bits(rate)
    link_s = per_trip * 8 / bits if bits else None
    for name, run in (("exchange", app), ("raw", raw)):
        t = {k: run[k] / run["repeats"] for k in TIMES}
        r[name] = dict(t, link_s=link_s, bound=bound(t, link_s))
    return r


TIMES = ("wall_s", "client_cpu_s", "server_cpu_s", "client_wait_s", "server_wait_s")


def bound(t: dict[str, float], link_s: float | None) -> str:
    """What a round trip's time is mostly made of: the link ("link": its floor, the bytes at the
    rate, is most of the wall time), or CPU ("CPU": both sides' CPU seconds; "CPU queue": their
    threads' wait for a core) beside the link ("link + CPU": CPU in series with the transfer, as
    CURVE's, which encrypts each message whole before sending it and decrypts it once all came)."""
    share = (link_s or 0.0) / t["wall_s"]
    if share >= 0.85:
        return "link"
    cpu, queue = t["client_cpu_s"] + t["server_cpu_s"], t["client_wait_s"] + t["server_wait_s"]
    which = "CPU" if cpu >= queue else "CPU queue"
    return f"link + {which}" if share >= 0.5 else which


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'rate':<8} {'case':<6} {'exchange MB/s':>13} {'raw MB/s':>9} {'ratio':>6}"]
    for r in rows:
        lines.append(
            f"{r['rate']:<8} {r['case']:<6} {r['exchange_mb_s']:>13.1f} {r['raw_mb_s']:>9.1f} {r['ratio']:>6.2f}"
        )
    return "\n".join(lines)


def where_the_time_goes(rows: list[dict[str, Any]]) -> str:
    """Per round trip (push + pull), ms: wall, the link's floor, each side's CPU (busy % of the
    wall), both sides' wait for a CPU, and what the time is mostly made of."""
    head = f"{'rate':<8} {'case':<6} {'path':<9} {'wall':>7} {'link':>7} {'client CPU':>13} {'server CPU':>13}"
    lines = [head + f" {'CPU queue':>9}  bound"]
    for r in rows:
        for name in ("exchange", "raw"):
            t = r[name]
            wall = t["wall_s"]
            client = f"{1e3 * t['client_cpu_s']:.1f} ({100 * t['client_cpu_s'] / wall:.0f}%)"
            server = f"{1e3 * t['server_cpu_s']:.1f} ({100 * t['server_cpu_s'] / wall:.0f}%)"
            link = f"{1e3 * t['link_s']:.1f}" if t["link_s"] else "-"
            queue = 1e3 * (t["client_wait_s"] + t["server_wait_s"])
            lines.append(
                f"{r['rate']:<8} {r['case']:<6} {name:<9} {1e3 * wall:>7.1f} {link:>7} {client:>13} {server:>13}"
                f" {queue:>9.1f}  {t['bound']}"
            )
    return "\n".join(lines)


@contextmanager
def _terminated_as_interrupted() -> Iterator[None]:
    """SIGTERM ends the run as Ctrl-C does: through its clean-up."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: SIGTERM stays as it was
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace, found: dict[str, str], rates: list[str], cases: list[str]) -> int:
    started, where = time.monotonic(), harness.machine()
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    link = Link(found)
    with tempfile.TemporaryDirectory(prefix="bench-wire-") as tmp, _terminated_as_interrupted():
        from app.exchange import secret

        args.secret = str(secret.make(os.path.join(tmp, "secret")))
        peers = Peers(link, tmp)
        try:
            link.stale()
            link.up()
            for rate in rates:
                link.shape(rate)
                for case in cases:
                    label = f"{rate} {case}"
                    raw = harness.attempt(
                        "bench wire", f"{label}: raw TCP", partial(measure, peers, "raw", case, args), failures
                    )
                    app = harness.attempt(
                        "bench wire", f"{label}: exchange", partial(measure, peers, "app", case, args), failures
                    )
                    if raw is not None and app is not None:
                        rows.append(row(rate, case, app, raw))
        finally:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the clean-up short
            try:
                peers.end_all()
                link.down()
            finally:
                signal.signal(signal.SIGINT, previous)
    wall = time.monotonic() - started
    where["loadavg_end"] = os.getloadavg()
    mb = 4 * args.floats / 1e6
    what = f"push + pull of {args.floats} float32 ({mb:.1f} MB each way) between two namespaces; MB/s: bytes both ways"
    text = f"{table(rows)}\n\nwhere the time goes, ms per round trip (push + pull):\n{where_the_time_goes(rows)}\n"
    text += harness.run_line(what, args.repeats, wall, where)
    settings = {k: v for k, v in vars(args).items() if k != "secret"}
    return harness.close(
        text,
        failures,
        args.json,
        lambda: dict(kind="wire", rows=rows, settings=settings, machine=where, failures=failures),
    )


def main(args: argparse.Namespace) -> int:
    found = tools()
    problem = refusal(found)
    try:
        rates = ["10gbit"] if args.quick and args.rates == "1gbit,10gbit" else args.rates.split(",")
        for rate in rates:
            rate_bits(rate)
        cases = args.cases.split(",")
        unknown = [c for c in cases if c not in CASES]
        if unknown:
            raise ValueError(f"--cases: {unknown[0]!r} is not one of {', '.join(CASES)}")
    except ValueError as error:
        problem = problem or str(error)
    if problem:
        print(f"python -m bench wire: {problem}", file=sys.stderr)
        return 2
    if args.quick:
        args.repeats, args.warmup = min(args.repeats, 3), min(args.warmup, 1)
    try:
        return run(args, found, rates, cases)
    except KeyboardInterrupt:
        print("python -m bench wire: interrupted (namespaces deleted, processes ended)", file=sys.stderr)
        return 130
