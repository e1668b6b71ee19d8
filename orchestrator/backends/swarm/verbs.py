"""The Swarm verbs: stack-up, stack-down, stack-logs, stack-status, stack-smoke.

The same topology as `up`, deployed with `docker stack deploy` (render:
`orchestrator.render.swarm`, Docker: `adapter`). `stack-up` runs the doctor
(target swarm) first, writes runs/<name>/stack.yaml and records the stack in
runs/stack.json, so `stack-logs`, `stack-status` and `stack-down` without `-c`
act on the stack deployed last.

A stack's tasks are one-shot: done when every service's newest task has
ended; judged like `smoke` (every service exited 0, no retry, the accuracy of
rank 0's `end` record at or above the threshold).
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

from orchestrator import images, runs
from orchestrator.backends import smoke as smoke_run
from orchestrator.backends.compose.adapter import run as run_argv
from orchestrator.backends.swarm import adapter, doctor
from orchestrator.doctor.checks import run_checks
from orchestrator.doctor.facts import gather
from orchestrator.doctor.report import stop_on_problems, summary
from orchestrator.errors import EngineError, UsageError, engine_errors
from orchestrator.host_paths import check_paths
from orchestrator.metrics.records import final_accuracy, parse_lines
from orchestrator.paths import DEFAULT_CONFIG, ROOT, RUNS, SMOKE_CONFIG, relative
from orchestrator.render import swarm as render_swarm
from orchestrator.render.compose import STATE_VOLUME
from orchestrator.render.yamlio import write_atomic, write_if_changed
from orchestrator.topology.model import Topology, load_with
from orchestrator.topology.services import PS_SERVICE, by_name, describe, order, rendezvous_service, service_names

RECORD = RUNS / "stack.json"
GONE_TIMEOUT = 120.0  # seconds `stack rm` has to remove the stack's containers and network


def stack_file(name: str) -> Path:
    return RUNS / name / "stack.yaml"


def render_text(t: Topology, nodes: int = 0) -> str:
    """The stack file; `nodes`: the swarm's node count (render_swarm.render), 0 when unknown."""
    return render_swarm.dump(render_swarm.render(t, data_root=str(ROOT), nodes=nodes), t.name)


def _stack(config: Optional[str], workers: Optional[int], stack: Optional[str]) -> str:
    """The stack named by `stack` or -c, else the one `stack-up` deployed last, else the default topology's."""
    if stack is not None:
        return stack
    if config is None and workers is None and RECORD.is_file():
        return json.loads(RECORD.read_text(encoding="utf-8"))["stack"]
    return render_swarm.stack_name(load_with(config or DEFAULT_CONFIG, workers=workers))


def _deploy(
    client: Any, t: Topology, name: str, path: Path, offline: bool, out: TextIO, env: dict[str, str]
) -> list[str]:
    """Build the image if missing, deploy with `env` (the run's variables, which the stack
    file interpolates); the options `docker stack deploy` said it ignored."""
    if images.image_exists(client, t.image_tag):
        print(
            f"==> image {t.image_tag} present on this node; every node that runs a task needs it "
            "(docs/multi-host.md: docker save | ssh NODE docker load)",
            file=out,
            flush=True,
        )
    else:
        base, pip_source = images.source(t, offline)
        images.build(t.image_tag, base, pip_source, out=out)
    print(f"==> deploying stack {name}: {describe(t)}", file=out, flush=True)
    r = run_argv(adapter.deploy_argv(name, str(path)), capture=True, env=env)
    ignored = adapter.ignored_options(r.stdout + r.stderr)
    for line in ignored:
        print(f"warning: docker stack deploy: {line}", file=out, flush=True)
    return ignored


@engine_errors
def stack_up(
    config: str,
    workers: Optional[int] = None,
    *,
    offline: bool = False,
    out: TextIO = sys.stdout,
    strategy: Optional[str] = None,
    resume: bool = False,
) -> int:
    """Deploy a new run (orchestrator.runs; `resume`: the PS continues the newest unfinished
    checkpoint), or, while the stack's run goes on, that run unchanged."""
    t = load_with(config, workers=workers, strategy=strategy)
    check_paths(t, config, ROOT)  # `code`, train.init_weights (made absolute under it in the stack file)
    client = images.client()
    facts = gather(t, client=client, target=doctor.gather_facts)
    checks = run_checks(doctor.CHECKS, t, facts)
    stop_on_problems(checks, config, "", target="swarm")
    print(f"==> doctor: {summary(checks)} (target swarm)", file=out, flush=True)
    name = render_swarm.stack_name(t)
    path = stack_file(name)
    wrote = write_if_changed(path, render_text(t, nodes=len(doctor.nodes(facts))))
    print(f"==> {'rendered' if wrote else 'up to date:'} {relative(path)}", file=out, flush=True)
    env, line = runs.start(adapter.running_env(client, name, runs.VARIABLES), resume)
    print(f"==> {line}", file=out, flush=True)
    _deploy(client, t, name, path, offline, out, env)
    RUNS.mkdir(parents=True, exist_ok=True)
    write_atomic(
        RECORD,
        json.dumps(
            {"stack": name, "stack_file": str(path), "config": config, "workers": workers, "strategy": strategy},
            indent=2,
        )
        + "\n",
    )
    print(f"==> up: stack {name}. Next: make stack-logs | make stack-status | make stack-down", file=out, flush=True)
    return 0


@engine_errors
def stack_down(
    config: Optional[str] = None,
    workers: Optional[int] = None,
    *,
    volumes: bool = False,
    stack: Optional[str] = None,
    out: TextIO = sys.stdout,
) -> int:
    name = _stack(config, workers, stack)
    client = images.client()
    run_argv(adapter.rm_argv(name), capture=True)
    _wait_gone(client, name)
    kept = (
        f"volumes removed: {', '.join(adapter.remove_volumes(client, name)) or 'none'}"
        if volumes
        else f"checkpoints and metrics kept in volume {name}_{STATE_VOLUME} on each node"
    )
    print(f"==> down: stack {name} removed (services, containers, network); {kept}", file=out)
    return 0


@engine_errors
def stack_logs(
    config: Optional[str] = None, workers: Optional[int] = None, *, follow: bool = True, stack: Optional[str] = None
) -> int:
    """Every service's log at once (`docker service logs` each), prefixed by task and node."""
    name = _stack(config, workers, stack)
    client = images.client()
    names = order(adapter.services(client, name), _known(config, workers, stack))
    if not names:
        raise EngineError(f"no stack {name} (make stack-up first)")
    procs = [subprocess.Popen(adapter.logs_argv(name, s, follow=follow)) for s in names]
    try:
        # `docker service logs -f` never ends by itself: stop following once every
        # task has ended (on two polls in a row: a failed task's retry comes a moment later).
        ended_before = False
        while any(p.poll() is None for p in procs):
            ended = follow and adapter.all_ended(adapter.states(client, name), names)
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


@engine_errors
def stack_status(
    config: Optional[str] = None,
    workers: Optional[int] = None,
    *,
    stack: Optional[str] = None,
    out: TextIO = sys.stdout,
) -> int:
    name = _stack(config, workers, stack)
    client = images.client()
    states = adapter.states(client, name)
    print(f"stack {name}", file=out)
    for line in format_states([states[s] for s in order(states, _known(config, workers, stack))]):
        print(line, file=out)
    return 0


def format_states(rows: list[dict[str, Any]]) -> list[str]:
    """One line per service: newest task's state, exit code, retries, error."""
    lines = [f"{'SERVICE':<10} {'TASK':<10} {'EXIT':>4} {'RETRIES':>7}  ERROR"]
    for r in rows:
        code = "-" if r["exit_code"] is None else str(r["exit_code"])
        lines.append(
            f"{r['service']:<10} {r['task'] or r['status']:<10} {code:>4} {r['restarts']:>7}  {r['error']}".rstrip()
        )
    return lines


def wait_done(
    client: Any, stack: str, expected: list[str], timeout: float, out: TextIO, every: float = 2.0
) -> Optional[dict[str, dict[str, Any]]]:
    """Poll until every expected service's newest task has ended, on two polls in
    a row (a failed task's retry appears a moment later); the states, or None."""

    def read() -> list[dict[str, Any]]:
        states = adapter.states(client, stack)
        return [states[s] for s in expected if s in states]

    final = smoke_run.wait(
        read,
        lambda states: len(states) == len(expected) and adapter.all_ended({s["service"]: s for s in states}, expected),
        timeout,
        out,
        every=every,
        settle=True,
    )
    return None if final is None else {s["service"]: s for s in final}


@engine_errors
def stack_smoke(
    config: str = SMOKE_CONFIG,
    workers: int = 2,
    *,
    timeout: float = 600,
    threshold: float = 0.90,
    stack: Optional[str] = None,
    out: TextIO = sys.stdout,
    strategy: Optional[str] = None,
) -> int:
    """The CPU topology as a swarm stack on this engine (a swarm manager): offline
    image, deploy, wait for every task to end, judge the tasks' exit states and
    rank 0's accuracy (its `end` record, read from its container on this engine);
    print every log on failure; always remove the stack, wait for its containers and
    network to go, and remove its volume."""
    timings = smoke_run.Timings("stack-smoke")
    t = load_with(config, workers=workers, strategy=strategy)
    name = stack or f"{render_swarm.stack_name(t)}-stack-smoke"
    client = images.client()
    expected = service_names(t)
    tmp = Path(tempfile.mkdtemp(prefix="ps-compose-stack-smoke-"))
    path = tmp / "stack.yaml"
    try:
        write_if_changed(path, render_text(t, nodes=_node_count(client)))
        base, pip_source = images.source(t, offline=True)
        with timings.step("image"):
            images.build(t.image_tag, base, pip_source, out=out)
        _remove(client, name)  # a former run's leftovers
        with timings.step("run"):
            ignored = _deploy(client, t, name, path, True, out, runs.environment(runs.new_id(), False))
            states = wait_done(client, name, expected, timeout, out)
        final = states if states is not None else adapter.states(client, name)
        rank0 = rendezvous_service(t)
        lines = adapter.read_metrics(client, name, rank0).get(by_name(t)[rank0].metrics_file, [])
        accuracy = final_accuracy(parse_lines(lines))
        problems = smoke_run.judge(
            expected, list(final.values()), accuracy, threshold, who="the PS" if rank0 == PS_SERVICE else rank0
        )
        if states is None:
            problems.insert(0, f"not every task ended within {timeout:.0f} s")
        problems += [f"docker stack deploy: {line}" for line in ignored]
        for line in format_states([final[s] for s in expected if s in final]):
            print(f"    {line}", file=out)
        if problems:
            for s in expected:
                for line in adapter.service_log(client, name, s).splitlines():
                    print(f"{s} | {line}", file=out)
            for p in problems:
                print(f"stack-smoke: FAILED: {p}", file=out)
            return 1
        print(
            f"stack-smoke: passed: Accuracy {accuracy:.4f} >= {threshold:.2f}; {len(expected)} tasks "
            f"complete, exit 0, no retry ({', '.join(expected)})",
            file=out,
        )
        return 0
    finally:
        with timings.step("down"):
            _remove(client, name)
        shutil.rmtree(tmp, ignore_errors=True)
        print(timings.line(), file=out, flush=True)


def _node_count(client: Any) -> int:
    """How many nodes the swarm has; 0 when this engine cannot tell (not a manager: the
    deploy then says so)."""
    try:
        return len(adapter.nodes(client))
    except Exception:  # noqa: BLE001 - docker.errors.APIError and the like
        return 0


def _wait_gone(client: Any, name: str) -> None:
    left = adapter.wait_gone(client, name, timeout=GONE_TIMEOUT)
    if left:
        raise EngineError(f"stack {name}: still there after {GONE_TIMEOUT:.0f} s: {', '.join(left)}")


def _remove(client: Any, name: str) -> None:
    """Remove the stack, wait for it to be gone, remove its volume (EngineError if it stays)."""
    run_argv(adapter.rm_argv(name), capture=True, check=False)
    _wait_gone(client, name)
    adapter.remove_volumes(client, name)


def _known(config: Optional[str], workers: Optional[int], stack: Optional[str]) -> Optional[Topology]:
    """The topology of the stack acted on, when known: from -c/--workers, else from the
    record of the last stack-up (when it names the stack); None otherwise."""
    if config is not None or workers is not None:
        return load_with(config or DEFAULT_CONFIG, workers=workers)
    if not RECORD.is_file():
        return None
    rec = json.loads(RECORD.read_text(encoding="utf-8"))
    if rec.get("config") is None or (stack is not None and stack != rec.get("stack")):
        return None
    try:
        return load_with(rec["config"], workers=rec.get("workers"), strategy=rec.get("strategy"))
    except UsageError:  # the file changed since: order by name
        return None
