"""`python -m orchestrator check`: the cluster's connectivity check, before training.

Every service of the topology runs `python -m app check` (app/connectivity.py) with
its own rank instead of its training role: rank 0 (the PS, or worker1 for
allreduce) hosts a store that every other rank registers with, then sends a
4 B and an 8 MiB tensor to each rank over Gloo and gets them back. Rank 0's
report is one line per rank: name, host, address, round trips and GB/s. A
rank that never registers within the timeout fails the check with its name.

In containers the check runs on the cluster's own image and network
definition, as a separate compose project (`<project>-check`): the render of
the topology with each service's command replaced and everything that would
block or is not needed (healthcheck, depends_on, restart, volumes, GPU
reservations, build) dropped. The project is always torn down. `--local` runs
the same ranks as processes on 127.0.0.1.

`plan_local`, `check_document` and `judge` are pure (unit tests); `run_containers`
and `run_local` do the work.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO

from app.contract import CHECK_RECORD
from orchestrator.errors import UsageError
from orchestrator.paths import ROOT
from orchestrator.render import compose
from orchestrator.render.yamlio import write_atomic
from orchestrator.topology.model import Topology
from orchestrator.topology.services import LABEL_RANK, LABEL_ROLE, services
from orchestrator.verbs.local import LOCALHOST, app_argv, free_port, loopback_ifname, service_environment, spawn

DEFAULT_TIMEOUT = 30.0
# What a service of the check keeps from the training render: who runs it, where, how safely.
KEPT_KEYS = ("image", "environment", "labels", "user", "init", "shm_size", "cap_drop", "security_opt", "networks")
ROLE = "check"
EXIT_MARGIN = 30.0  # beyond the app's own timeouts, before a rank that has not exited counts as hung


@dataclass(frozen=True)
class Result:
    """How one rank's process (or container) ended: exit code (None: never exited) and output."""

    name: str
    rank: int
    code: Optional[int]
    output: str


def rank_names(t: Topology) -> list[str]:
    """The services in rank order; rank 0 hosts the check (the PS, or worker1 for allreduce)."""
    return [s.name for s in services(t)]


def project_name(t: Topology) -> str:
    return f"{compose.project_name(t)}-check"


def check_without(t: Topology, without: Sequence[str]) -> None:
    """UsageError unless every name in `without` is a service of `t`."""
    names = rank_names(t)
    for name in without:
        if name not in names:
            raise UsageError(f"--without {name}: not a service of this topology ({', '.join(names)})")


def check_environment(t: Topology, rank: int, *, master_addr: str, master_port: int, timeout: float) -> dict[str, str]:
    """The PSC_* variables the check reads, over the rank's training environment."""
    return {
        "PSC_RANK": str(rank),
        "PSC_WORLD_SIZE": str(len(rank_names(t))),
        "PSC_MASTER_ADDR": master_addr,
        "PSC_MASTER_PORT": str(master_port),
        "PSC_STRATEGY": t.train.strategy,
        "PSC_SHARDS": str(t.ps.shards),
        "PSC_SHARD": "0",  # a shard's PSC_SHARD is for its ps role; the check knows it by rank
        "PSC_RPC_TIMEOUT": f"{timeout:g}",
    }


def check_document(t: Topology, *, timeout: float = DEFAULT_TIMEOUT, without: Sequence[str] = ()) -> dict[str, Any]:
    """The compose document of the check: the topology's render, each service running
    `check --rank R`, on the same image, network and environment; nothing that waits
    (healthcheck, depends_on), restarts, mounts or reserves a GPU. The services in
    `without` are left out (the world size stays: the check then fails naming them)."""
    check_without(t, without)
    doc = compose.render(t, one_host=False)  # the check crosses the network, as TCP would
    names = rank_names(t)
    services: dict[str, Any] = {}
    for rank, name in enumerate(names):
        if name in without:
            continue
        svc = {k: doc["services"][name][k] for k in KEPT_KEYS if k in doc["services"][name]}
        svc["command"] = [ROLE, "--rank", str(rank)]
        svc["environment"] = {
            **svc.get("environment", {}),
            **check_environment(t, rank, master_addr=names[0], master_port=t.ps.rpc_port, timeout=timeout),
        }
        svc["labels"] = {**svc.get("labels", {}), LABEL_ROLE: ROLE, LABEL_RANK: str(rank)}
        services[name] = svc
    out: dict[str, Any] = {"services": services}
    if "networks" in doc:
        out["networks"] = doc["networks"]
    return out


@dataclass(frozen=True)
class LocalRank:
    name: str
    rank: int
    argv: list[str]
    env: dict[str, str]


def plan_local(
    t: Topology,
    *,
    port: int,
    timeout: float = DEFAULT_TIMEOUT,
    without: Sequence[str] = (),
    run_dir: Path = Path("runs"),
    ifname: str = "lo",
    python: str = sys.executable,
) -> list[LocalRank]:
    """One `python -m app check --rank R` process per service on 127.0.0.1, in rank order."""
    check_without(t, without)
    plan = []
    for rank, service in enumerate(services(t)):
        if service.name in without:
            continue
        # The service's training environment, under the check's own rank and world.
        env = service_environment(t, service, port=port, run_dir=run_dir, ifname=ifname)
        env.update(check_environment(t, rank, master_addr=LOCALHOST, master_port=port, timeout=timeout))
        env["GLOO_SOCKET_IFNAME"] = ifname
        plan.append(LocalRank(service.name, rank, app_argv(ROLE, "--rank", str(rank), python=python), env))
    return plan


# --- judging (pure) ----------------------------------------------------------


def result_record(output: str) -> Optional[dict[str, Any]]:
    """A rank's result: the JSON after the CHECK_RECORD mark on its last such line (the
    check's declared output for the orchestrator; its other lines are for people); None
    when it wrote none (it crashed, or did not get that far)."""
    for line in reversed(output.splitlines()):
        if line.startswith(CHECK_RECORD):
            try:
                record = json.loads(line[len(CHECK_RECORD) :])
            except ValueError:
                return None
            return record if isinstance(record, dict) else None
    return None


@dataclass(frozen=True)
class Verdict:
    lines: list[str]  # rank 0's report, then one `check failed:` line per problem
    failing: list[str]  # the ranks to blame, in rank order (empty when passed)
    passed: bool


def judge(names: Sequence[str], results: Sequence[Result], without: Sequence[str] = ()) -> Verdict:
    """What to print and whom to blame, from every rank's outcome and result record.

    Rank 0's report first (its `check:` lines); then one line per problem: rank 0's
    own failure (it names the ranks that never registered or broke an exchange), any
    other rank's (one that cannot reach rank 0 names the address), ranks that did not
    exit, crashed without a result, or were left out. A rank that cannot reach rank 0 is
    to blame itself when rank 0 reported, else rank 0 is."""
    by_name = {r.name: r for r in results}
    first = by_name.get(names[0])
    rank0 = result_record(first.output) if first is not None else None
    rank0_ok = first is not None and first.code is not None and rank0 is not None
    lines: list[str] = list(rank0["report"]) if rank0 else []
    problems: list[str] = []
    blame: set[str] = set()
    for rank, name in enumerate(names):
        r = by_name.get(name)
        if r is None:
            if name in without:
                problems.append(f"{name} (rank {rank}) was not started (--without {name})")
                blame.add(name)
            continue
        record = result_record(r.output)
        if r.code is None:
            problems.append(f"{name} (rank {rank}) did not exit in time")
            blame.add(name)
        elif record is not None and record.get("failed"):
            if record.get("called_off"):
                continue  # rank 0's own result says why
            problems.append(record["failed"])
            if rank == 0:
                blame.update(record.get("blame") or [])
            elif record.get("unreachable") and not rank0_ok:
                blame.add(names[0])
            else:
                blame.add(name)
        elif r.code != 0 or record is None:
            text = [ln for ln in r.output.strip().splitlines() if not ln.startswith(CHECK_RECORD)]
            last = (text or ["no output"])[-1].strip()
            problems.append(f"{name} (rank {rank}) exited {r.code}: {last}")
            blame.add(name)
    passed = not problems and first is not None and first.code == 0 and bool(rank0 and rank0.get("passed"))
    if not passed and not problems:
        problems.append(f"{names[0]} (rank 0) did not report a passed check")
        blame.add(names[0])
    lines += [f"check failed: {p}" for p in problems]
    return Verdict(lines, [n for n in names if n in blame], passed)


def _summary(names: Sequence[str], v: Verdict, where: str, seconds: float) -> str:
    if v.passed:
        return f"==> check passed: {', '.join(names)} ({where}, {seconds:.0f} s)"
    return f"==> check FAILED: {', '.join(v.failing) or '?'} ({where}, {seconds:.0f} s)"


# --- as processes ----------------------------------------------------------------


def run_local(
    t: Topology, *, timeout: float = DEFAULT_TIMEOUT, without: Sequence[str] = (), out: TextIO = sys.stdout
) -> int:
    start = time.monotonic()
    port = free_port()
    names = rank_names(t)
    tmp = Path(tempfile.mkdtemp(prefix="ps-compose-check-"))
    plan = plan_local(t, port=port, timeout=timeout, without=without, run_dir=tmp, ifname=loopback_ifname())
    print(
        f"==> check: {len(names)} ranks ({', '.join(names)}) as processes on {LOCALHOST}:{port}, timeout {timeout:g} s",
        file=out,
        flush=True,
    )
    procs: dict[str, tuple[LocalRank, subprocess.Popen, Any]] = {}
    try:
        for spec in plan:
            log = open(tmp / f"{spec.name}.log", "w+", encoding="utf-8")
            p = spawn(spec.argv, spec.env, stdout=log)
            procs[spec.name] = (spec, p, log)
        deadline = time.monotonic() + 2 * timeout + EXIT_MARGIN
        for _, p, _ in procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        results = []
        for spec, p, log in procs.values():
            code = p.poll()
            if code is None:
                p.kill()
                p.wait()
            log.seek(0)
            results.append(Result(spec.name, spec.rank, code, log.read()))
    finally:
        for _, p, log in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return _print_verdict(names, results, without, "processes", time.monotonic() - start, out)


def _print_verdict(
    names: Sequence[str], results: Sequence[Result], without: Sequence[str], where: str, seconds: float, out: TextIO
) -> int:
    v = judge(names, results, without)
    for line in v.lines:
        print(line, file=out)
    print(_summary(names, v, where, seconds), file=out, flush=True)
    return 0 if v.passed else 1


# --- in containers -----------------------------------------------------------------


def run_containers(
    t: Topology,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    without: Sequence[str] = (),
    build: bool = False,
    offline: bool = False,
    project: Optional[str] = None,
    out: TextIO = sys.stdout,
) -> int:
    from orchestrator import images
    from orchestrator.backends import command
    from orchestrator.backends.compose import adapter
    from orchestrator.backends.compose.status import container_state

    start = time.monotonic()
    names = rank_names(t)
    doc = check_document(t, timeout=timeout, without=without)
    client = images.client()
    found = adapter.detect()
    if build or not images.image_exists(client, t.image_tag):
        base, pip_source = images.source(t, offline)
        images.build(t.image_tag, base, pip_source, out=out)
    name = project or project_name(t)
    tmp = Path(tempfile.mkdtemp(prefix="ps-compose-check-"))
    proj = adapter.Project(name, str(tmp / "compose.yaml"), str(ROOT))
    try:
        write_atomic(proj.file, compose.dump(doc, t.name))
        command.run(
            adapter.down_argv(found, proj, volumes=True), capture=True, check=False
        )  # a former check's leftovers
        print(
            f"==> check: {len(names)} ranks ({', '.join(names)}) in containers of {t.image_tag}, "
            f"project {name}, timeout {timeout:g} s",
            file=out,
            flush=True,
        )
        command.run(adapter.up_argv(found, proj), capture=True)
        states = adapter.wait_exited(client, name, len(doc["services"]), 2 * timeout + EXIT_MARGIN, out, every=0.5)
        results = []
        for c in adapter.containers(client, name):
            state = container_state(c.attrs)
            svc = state.service
            results.append(
                Result(
                    svc,
                    names.index(svc) if svc in names else -1,
                    state.exit_code if state.ended else None,
                    c.logs(stdout=True, stderr=True).decode("utf-8", "replace"),
                )
            )
        if states is None:
            print(f"    not every container exited within {2 * timeout + EXIT_MARGIN:.0f} s", file=out)
        _hint_stale_image(results, t, out)
        return _print_verdict(names, results, without, f"containers, project {name}", time.monotonic() - start, out)
    finally:
        command.run(adapter.down_argv(found, proj, volumes=True), capture=True, check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def _hint_stale_image(results: Sequence[Result], t: Topology, out: TextIO) -> None:
    if any(r.code == 2 and "invalid choice: 'check'" in r.output for r in results):
        print(f"    the image {t.image_tag} predates the check: rebuild it (make build, or check --build)", file=out)


def run(
    t: Topology,
    *,
    local: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    without: Sequence[str] = (),
    build: bool = False,
    offline: bool = False,
    out: TextIO = sys.stdout,
) -> int:
    """The check of `t`, as processes (`local`) or in containers; the exit status."""
    check_without(t, without)
    if len(rank_names(t)) < 2:
        print(f"==> check: one rank ({rank_names(t)[0]}): no network between ranks to check", file=out)
        return 0
    if local:
        return run_local(t, timeout=timeout, without=without, out=out)
    return run_containers(t, timeout=timeout, without=without, build=build, offline=offline, out=out)
