"""The Swarm verbs: stack-up, stack-down, stack-logs, stack-status, stack-smoke.

The same topology as `up`, deployed with `docker stack deploy` (render:
`orchestrator.render_swarm`, Docker: `orchestrator.stack`). `stack-up`
runs the doctor (target swarm) first, writes runs/<name>/stack.yaml and
records the stack in runs/stack.json, so `stack-logs`, `stack-status` and
`stack-down` without `-c` act on the stack deployed last.

A stack's tasks are one-shot: done when every service's newest task has
ended; judged like `smoke` (every service exited 0, no retry, the PS's last
`Accuracy:` line at or above the threshold).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, TextIO

from orchestrator import UsageError
from orchestrator import cluster as cl
from orchestrator import compose as cp
from orchestrator import doctor, images
from orchestrator import render as rd
from orchestrator import render_swarm as rs
from orchestrator import stack as st
from orchestrator.services import order
from orchestrator.topology import Topology, load
from orchestrator.usercode import check_paths

RECORD_NAME = "stack.json"
SMOKE_CONFIG = cl.SMOKE_CONFIG


def stack_file(name: str) -> Path:
    return cl.RUNS / name / "stack.yaml"


def render_text(t: Topology) -> str:
    return rs.dump(rs.render(t, data_root=str(cl.ROOT)), t.name)


def _topology(config: str, workers: Optional[int], strategy: Optional[str] = None) -> Topology:
    t = load(config)
    t = t.with_workers(workers) if workers is not None else t
    return t.with_strategy(strategy) if strategy is not None else t


def _stack(config: Optional[str], workers: Optional[int], stack: Optional[str]) -> str:
    """The stack named by `stack` or -c, else the one `stack-up` deployed last, else the default topology's."""
    if stack is not None:
        return stack
    record = cl.RUNS / RECORD_NAME
    if config is None and workers is None and record.is_file():
        return json.loads(record.read_text(encoding="utf-8"))["stack"]
    return rs.stack_name(_topology(config or "configs/default.yaml", workers))


def _write(path: Path, text: str) -> bool:
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    rd.write_atomic(path, text)
    return True


def _deploy(client: Any, t: Topology, name: str, path: Path, offline: bool, out: TextIO) -> list[str]:
    """Build the image if missing, deploy; the options `docker stack deploy` said it ignored."""
    if images.image_exists(client, t.image_tag):
        print(f"==> image {t.image_tag} present on this node; every node that runs a task needs it "
              "(docs/multi-host.md: docker save | ssh NODE docker load)", file=out, flush=True)
    else:
        base, pip_source = images.source(t, offline)
        images.build(t.image_tag, base, pip_source, out=out)
    print(f"==> deploying stack {name}: {rd.describe(t)}", file=out, flush=True)
    r = cp.run(st.deploy_argv(name, str(path)), capture=True)
    ignored = st.ignored_options(r.stdout + r.stderr)
    for line in ignored:
        print(f"warning: docker stack deploy: {line}", file=out, flush=True)
    return ignored


@cl.engine_errors
def stack_up(config: str, workers: Optional[int] = None, *, offline: bool = False, out: TextIO = sys.stdout,
             strategy: Optional[str] = None) -> int:
    t = _topology(config, workers, strategy)
    check_paths(t, config, cl.ROOT)  # `code`, train.init_weights (made absolute under it in the stack file)
    client = images.client()
    checks = doctor.run_checks(t, "swarm", doctor.gather(t, "swarm", client=client))
    doctor.stop_on_problems(checks, config, "", target="swarm")
    print(f"==> doctor: {len(checks)} checks passed (target swarm)", file=out, flush=True)
    name = rs.stack_name(t)
    path = stack_file(name)
    wrote = _write(path, render_text(t))
    print(f"==> {'rendered' if wrote else 'up to date:'} {cl._rel(path)}", file=out, flush=True)
    _deploy(client, t, name, path, offline, out)
    cl.RUNS.mkdir(parents=True, exist_ok=True)
    rd.write_atomic(cl.RUNS / RECORD_NAME, json.dumps({"stack": name, "stack_file": str(path), "config": config,
                                                      "workers": workers, "strategy": strategy},
                                                      indent=2) + "\n")
    print(f"==> up: stack {name}. Next: make stack-logs | make stack-status | make stack-down", file=out, flush=True)
    return 0


@cl.engine_errors
def stack_down(config: Optional[str] = None, workers: Optional[int] = None, *, volumes: bool = False,
               stack: Optional[str] = None, out: TextIO = sys.stdout) -> int:
    name = _stack(config, workers, stack)
    client = images.client()
    cp.run(st.rm_argv(name), capture=True)
    left = st.wait_gone(client, name)
    if left:
        raise cp.EngineError(f"stack {name}: still there after 120 s: {', '.join(left)}")
    kept = f"volumes removed: {', '.join(st.remove_volumes(client, name)) or 'none'}" if volumes else \
        f"checkpoints and metrics kept in volume {name}_{rd.STATE_VOLUME} on each node"
    print(f"==> down: stack {name} removed (services, containers, network); {kept}", file=out)
    return 0


@cl.engine_errors
def stack_logs(config: Optional[str] = None, workers: Optional[int] = None, *, follow: bool = True,
               stack: Optional[str] = None) -> int:
    """Every service's log at once (`docker service logs` each), prefixed by task and node."""
    name = _stack(config, workers, stack)
    client = images.client()
    names = order(st.services(client, name), _known(config, workers, stack))
    if not names:
        raise cp.EngineError(f"no stack {name} (make stack-up first)")
    procs = [subprocess.Popen(st.logs_argv(name, s, follow=follow)) for s in names]
    try:
        # `docker service logs -f` never ends by itself: stop following once every
        # task has ended (on two polls in a row: a failed task's retry comes a moment later).
        ended_before = False
        while any(p.poll() is None for p in procs):
            ended = follow and _all_ended(client, name, names)
            if ended and ended_before:
                break
            ended_before = ended
            time.sleep(2)
        return 0 if follow else max(p.wait() for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()


def _all_ended(client: Any, stack: str, names: list[str]) -> bool:
    states = st.states(client, stack)
    return all(s in states and states[s]["status"] == "exited" for s in names)


@cl.engine_errors
def stack_status(config: Optional[str] = None, workers: Optional[int] = None, *, stack: Optional[str] = None,
                 out: TextIO = sys.stdout) -> int:
    name = _stack(config, workers, stack)
    client = images.client()
    states = st.states(client, name)
    print(f"stack {name}", file=out)
    for line in format_states([states[s] for s in order(states, _known(config, workers, stack))]):
        print(line, file=out)
    return 0


def format_states(rows: list[dict[str, Any]]) -> list[str]:
    """One line per service: newest task's state, exit code, retries, error."""
    lines = [f"{'SERVICE':<10} {'TASK':<10} {'EXIT':>4} {'RETRIES':>7}  ERROR"]
    for r in rows:
        code = "-" if r["exit_code"] is None else str(r["exit_code"])
        lines.append(f"{r['service']:<10} {r['task'] or r['status']:<10} {code:>4} {r['restarts']:>7}  {r['error']}".rstrip())
    return lines


def wait_done(client: Any, stack: str, expected: list[str], timeout: float, out: TextIO,
              every: float = 2.0) -> Optional[dict[str, dict[str, Any]]]:
    """Poll until every expected service's newest task has ended, on two polls in
    a row (a failed task's retry appears a moment later); the states, or None."""
    start = last_report = time.monotonic()
    ended_before = False
    while time.monotonic() - start < timeout:
        states = st.states(client, stack)
        ended = all(s in states and states[s]["status"] == "exited" for s in expected)
        if ended and ended_before:
            return states
        ended_before = ended
        if time.monotonic() - last_report >= 15:
            last_report = time.monotonic()
            summary = ", ".join(f"{s} {states[s]['task']}" for s in expected if s in states)
            print(f"    {time.monotonic() - start:4.0f} s: {summary}", file=out, flush=True)
        time.sleep(every)
    return None


@cl.engine_errors
def stack_smoke(config: str = SMOKE_CONFIG, workers: int = 2, *, timeout: float = 600, threshold: float = 0.90,
                stack: Optional[str] = None, out: TextIO = sys.stdout) -> int:
    """The CPU topology as a swarm stack on this engine (a swarm manager): offline
    image, deploy, wait for every task to end, judge the tasks' exit states and
    the PS's `Accuracy:`; print every log on failure; always remove the stack,
    wait for its containers and network to go, and remove its volume."""
    t0 = time.monotonic()
    t = _topology(config, workers)
    name = stack or f"{rs.stack_name(t)}-stack-smoke"
    client = images.client()
    expected = rd.service_names(t)
    timings: dict[str, float] = {}
    tmp = Path(tempfile.mkdtemp(prefix="ps-compose-stack-smoke-"))
    path = tmp / "stack.yaml"
    try:
        _write(path, render_text(t))
        base, pip_source = images.source(t, offline=True)
        start = time.monotonic()
        images.build(t.image_tag, base, pip_source, out=out)
        timings["image"] = time.monotonic() - start
        _remove(client, name)  # a former run's leftovers
        start = time.monotonic()
        ignored = _deploy(client, t, name, path, True, out)
        states = wait_done(client, name, expected, timeout, out)
        timings["run"] = time.monotonic() - start
        final = states if states is not None else st.states(client, name)
        rank0 = rd.rendezvous_service(t)
        accuracy = cl.parse_accuracy(st.service_log(client, name, rank0))
        problems = cl.judge(expected, list(final.values()), accuracy, threshold,
                            who="the PS" if rank0 == rd.PS_SERVICE else rank0)
        if states is None:
            problems.insert(0, f"not every task ended within {timeout:.0f} s")
        problems += [f"docker stack deploy: {line}" for line in ignored]
        for line in format_states([final[s] for s in expected if s in final]):
            print(f"    {line}", file=out)
        if problems:
            for s in expected:
                for line in st.service_log(client, name, s).splitlines():
                    print(f"{s} | {line}", file=out)
            for p in problems:
                print(f"stack-smoke: FAILED: {p}", file=out)
            return 1
        print(f"stack-smoke: passed: Accuracy {accuracy:.4f} >= {threshold:.2f}; {len(expected)} tasks "
              f"complete, exit 0, no retry ({', '.join(expected)})", file=out)
        return 0
    finally:
        start = time.monotonic()
        _remove(client, name)
        timings["down"] = time.monotonic() - start
        shutil.rmtree(tmp, ignore_errors=True)
        steps = ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
        print(f"stack-smoke: {steps}; total {time.monotonic() - t0:.0f} s", file=out, flush=True)


def _remove(client: Any, name: str) -> None:
    """Remove the stack, wait for it to be gone, remove its volume (EngineError if it stays)."""
    cp.run(st.rm_argv(name), capture=True, check=False)
    left = st.wait_gone(client, name)
    if left:
        raise cp.EngineError(f"stack {name}: still there after 120 s: {', '.join(left)}")
    st.remove_volumes(client, name)


def _known(config: Optional[str], workers: Optional[int], stack: Optional[str]) -> Optional[Topology]:
    """The topology of the stack acted on, when known: from -c/--workers, else from the
    record of the last stack-up (when it names the stack); None otherwise."""
    if config is not None or workers is not None:
        return _topology(config or "configs/default.yaml", workers)
    record = cl.RUNS / RECORD_NAME
    if not record.is_file():
        return None
    rec = json.loads(record.read_text(encoding="utf-8"))
    if rec.get("config") is None or (stack is not None and stack != rec.get("stack")):
        return None
    try:
        return _topology(rec["config"], rec.get("workers"), rec.get("strategy"))
    except UsageError:  # the file changed since: order by name
        return None
