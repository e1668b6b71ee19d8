"""The container verbs: build, up, down, logs, status, smoke.

Each verb is a function returning an exit status; the CLI only parses and
calls them. Docker is reached through `orchestrator.images` (SDK: build,
container state, metrics) and `orchestrator.compose` (the compose command
line); the parsing and judging below are pure functions with unit tests.

Files: `up` renders the topology to runs/<project>/compose.yaml (compose.yaml at
the top stays the rendered default, kept in git) and records the project in
runs/current.json, so `logs`, `status` and `down` without `-c` act on the
cluster `up` started last.
"""

from __future__ import annotations

import functools
import io
import json
import re
import shutil
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, TextIO

import yaml

from orchestrator import compose as cp
from orchestrator import doctor, images
from orchestrator import render as rd
from orchestrator import services as sv
from orchestrator.topology import Topology, load
from orchestrator.usercode import check_paths

ROOT = images.ROOT
RUNS = ROOT / "runs"
CURRENT = RUNS / "current.json"
SMOKE_CONFIG = "configs/cpu-smoke.yaml"
CPU_HINT = "CONFIG=configs/cpu-smoke.yaml runs anywhere: make up CONFIG=configs/cpu-smoke.yaml WORKERS=3"
_ACCURACY = re.compile(r"^Accuracy:\s*([0-9]*\.?[0-9]+)", re.MULTILINE)


def engine_errors(fn: Callable[..., int]) -> Callable[..., int]:
    """An EngineError (no daemon, no compose, a failed build) is one line and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> int:
        try:
            return fn(*args, **kwargs)
        except cp.EngineError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    return wrapper


# --- which cluster --------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """A cluster to act on: its compose project, and its topology when known."""

    project: cp.Project
    topology: Optional[Topology] = None
    config: Optional[str] = None


def compose_file(project: str) -> Path:
    return RUNS / project / "compose.yaml"


def target(config: Optional[str], workers: Optional[int], *, project: Optional[str] = None,
           strategy: Optional[str] = None) -> Target:
    """The cluster named by `-c/--workers/--strategy`; with none, the one `up` started
    last (runs/current.json), else the default topology."""
    if config is None and workers is None and strategy is None and project is None and CURRENT.is_file():
        rec = json.loads(CURRENT.read_text(encoding="utf-8"))
        return Target(cp.Project(rec["project"], rec["compose_file"], str(ROOT)), config=rec.get("config"))
    config = config or "configs/default.yaml"
    t = load(config)
    if workers is not None:
        t = t.with_workers(workers)
    if strategy is not None:
        t = t.with_strategy(strategy)
    name = project or rd.project_name(t)
    return Target(cp.Project(name, str(compose_file(name)), str(ROOT)), t, config)


def render_if_needed(t: Topology, path: Path) -> bool:
    """Write the compose file of `t` to `path` unless it already holds exactly that."""
    text = rd.dump(rd.render(t), t.name)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    rd.write_atomic(path, text)
    return True


def preflight(t: Topology, config: str, client: Any, out: TextIO) -> None:
    """The doctor's checks (orchestrator/doctor.py); stop before starting anything
    when one fails (UsageError: the first problem and its fix, one line)."""
    check_paths(t, config, ROOT)  # `code`, train.init_weights: relative to the repository, as compose mounts them
    checks = doctor.run_checks(t, "compose", doctor.gather(t, "compose", client=client))
    doctor.stop_on_problems(checks, config, CPU_HINT if t.cuda or t.reads_files else "")
    print(f"==> doctor: {len(checks)} checks passed (python -m orchestrator doctor lists them)", file=out, flush=True)


# --- verbs ----------------------------------------------------------------

@engine_errors
def build(config: str, workers: Optional[int] = None, *, offline: bool = False, verbose: bool = False) -> int:
    t = target(config, workers).topology
    assert t is not None
    base, pip_source = images.source(t, offline)
    images.build(t.image_tag, base, pip_source, verbose=verbose)
    return 0


@engine_errors
def up(config: str, workers: Optional[int] = None, *, offline: bool = False,
       project: Optional[str] = None, remember: bool = True, out: TextIO = sys.stdout,
       strategy: Optional[str] = None) -> int:
    tg = target(config, workers, project=project, strategy=strategy)
    t = tg.topology
    assert t is not None
    client = images.client()
    preflight(t, config, client, out)
    compose = cp.detect()
    path = Path(tg.project.file)
    wrote = render_if_needed(t, path)
    print(f"==> {'rendered' if wrote else 'up to date:'} {_rel(path)}: {rd.describe(t)}, "
          f"project {tg.project.name}", file=out, flush=True)
    if images.image_exists(client, t.image_tag):
        print(f"==> image {t.image_tag} present (make build rebuilds it)", file=out, flush=True)
    else:
        base, pip_source = images.source(t, offline)
        images.build(t.image_tag, base, pip_source, out=out)
    print(f"==> starting with {compose}", file=out, flush=True)
    cp.run(cp.up_argv(compose, tg.project))
    if remember:
        _remember(tg)
    print(f"==> up: project {tg.project.name}. Next: make logs | make status | make down", file=out, flush=True)
    return 0


@engine_errors
def down(config: Optional[str] = None, workers: Optional[int] = None, *,
         volumes: bool = False, project: Optional[str] = None, strategy: Optional[str] = None) -> int:
    tg = target(config, workers, project=project, strategy=strategy)
    images.client()
    if tg.topology is not None:
        render_if_needed(tg.topology, Path(tg.project.file))
    cp.run(cp.down_argv(cp.detect(), tg.project, volumes=volumes))
    kept = "volume removed" if volumes else f"checkpoints and metrics kept in volume {tg.project.name}_{rd.STATE_VOLUME}"
    print(f"==> down: project {tg.project.name} stopped and removed; {kept}")
    return 0


@engine_errors
def logs(config: Optional[str] = None, workers: Optional[int] = None, *,
         follow: bool = True, project: Optional[str] = None, strategy: Optional[str] = None) -> int:
    tg = target(config, workers, project=project, strategy=strategy)
    images.client()
    if tg.topology is not None:
        render_if_needed(tg.topology, Path(tg.project.file))
    argv = cp.logs_argv(cp.detect(), tg.project, follow=follow, color=sys.stdout.isatty())
    return cp.run(argv, check=False).returncode


@engine_errors
def status(config: Optional[str] = None, workers: Optional[int] = None, *,
           project: Optional[str] = None, out: TextIO = sys.stdout, strategy: Optional[str] = None) -> int:
    tg = target(config, workers, project=project, strategy=strategy)
    client = images.client()
    containers = _containers(client, tg.project.name)
    listed = status_services(_configured(tg), [c.attrs for c in containers])
    metrics = read_metrics(client, tg.project.name, containers)
    rows = [service_row(s.name, attrs, metrics.get(s.metrics_file, [])) for s, attrs in listed]
    print(f"project {tg.project.name} ({_rel(Path(tg.project.file))})", file=out)
    for line in format_status(rows):
        print(line, file=out)
    return 0


@engine_errors
def smoke(config: str = SMOKE_CONFIG, workers: int = 2, *, timeout: float = 900, threshold: float = 0.90,
          project: Optional[str] = None, out: TextIO = sys.stdout, strategy: Optional[str] = None) -> int:
    """The CPU cluster end to end in real containers: offline image, up, wait for
    every container to exit, check rank 0's `Accuracy:` (the PS's, or worker1's
    for allreduce) and every exit status, print every log on failure, always tear
    down (volume included)."""
    t0 = time.monotonic()
    t = load(config).with_workers(workers)
    if strategy is not None:
        t = t.with_strategy(strategy)
    name = project or f"{rd.project_name(t)}-smoke"
    client = images.client()
    compose = cp.detect()
    tmp = Path(tempfile.mkdtemp(prefix="ps-compose-smoke-"))
    proj = cp.Project(name, str(tmp / "compose.yaml"), str(ROOT))
    timings: dict[str, float] = {}
    try:
        rd.write_atomic(proj.file, rd.dump(rd.render(t), t.name))
        base, pip_source = images.source(t, offline=True)
        start = time.monotonic()
        images.build(t.image_tag, base, pip_source, out=out)
        timings["image"] = time.monotonic() - start
        cp.run(cp.down_argv(compose, proj, volumes=True), capture=True, check=False)  # a former run's leftovers
        print(f"==> smoke: project {name}, {rd.describe(t)}, with {compose}", file=out, flush=True)
        start = time.monotonic()
        cp.run(cp.up_argv(compose, proj))
        expected = rd.service_names(t)
        finished = wait_exited(client, name, len(expected), timeout, out)
        timings["run"] = time.monotonic() - start
        states = [container_state(c.attrs) for c in _containers(client, name)]
        rank0 = rd.rendezvous_service(t)
        ps_log = _log_text(client, name, rank0)
        problems = judge(expected, states, parse_accuracy(ps_log), threshold,
                         who="the PS" if rank0 == rd.PS_SERVICE else rank0)
        if finished is None:
            problems.insert(0, f"not every container exited within {timeout:.0f} s")
        if problems:
            print_logs(client, name, out)
            for p in problems:
                print(f"smoke: FAILED: {p}", file=out)
            return 1
        print(f"smoke: passed: Accuracy {parse_accuracy(ps_log):.4f} >= {threshold:.2f}; "
              f"{len(expected)} containers exited 0 ({', '.join(expected)})", file=out)
        return 0
    finally:
        start = time.monotonic()
        cp.run(cp.down_argv(compose, proj, volumes=True), capture=True, check=False)
        timings["down"] = time.monotonic() - start
        shutil.rmtree(tmp, ignore_errors=True)
        steps = ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
        print(f"smoke: {steps}; total {time.monotonic() - t0:.0f} s", file=out, flush=True)


# --- Docker reads ---------------------------------------------------------

def _containers(client: Any, project: str) -> list[Any]:
    return client.containers.list(all=True, filters={"label": f"{cp.LABEL_PROJECT}={project}"})


def _configured(tg: Target) -> list[sv.Service]:
    """The services the cluster is configured with: the topology's, else those of the
    compose file `up` rendered (none when it cannot be read)."""
    if tg.topology is not None:
        return sv.services(tg.topology)
    try:
        doc = yaml.safe_load(Path(tg.project.file).read_text(encoding="utf-8"))
        return sv.from_compose(doc)
    except (OSError, yaml.YAMLError, AttributeError, TypeError, ValueError):
        return []


def read_metrics(client: Any, project: str, containers: list[Any]) -> dict[str, list[str]]:
    """The lines of every metrics file in the project's /state volume, by file name.
    Read from a container of the project (running or stopped); after `down`, from a
    container created (never started) on the volume for the purpose."""
    # The PS's container, else any (allreduce has no PS): they all mount the volume.
    source = next((c for c in containers if c.labels.get(cp.LABEL_SERVICE) == rd.PS_SERVICE),
                  containers[0] if containers else None)
    scratch = None
    try:
        if source is None:
            volume = f"{project}_{rd.STATE_VOLUME}"
            image = _any_image(client)
            if image is None or not _volume_exists(client, volume):
                return {}
            scratch = source = client.containers.create(
                image, command=["true"], volumes={volume: {"bind": rd.STATE_DIR, "mode": "ro"}},
                labels={"ps-compose.scratch": project})
        stream, _ = source.get_archive(rd.METRICS_DIR)
        return metrics_from_tar(b"".join(stream))
    except Exception:  # noqa: BLE001 - no metrics yet is not an error for `status`
        return {}
    finally:
        if scratch is not None:
            scratch.remove(force=True)


def _any_image(client: Any) -> Optional[str]:
    for img in client.images.list(filters={"dangling": False}):
        if any(tag.startswith("ps-compose-") for tag in img.tags):
            return img.id
    return None


def _volume_exists(client: Any, name: str) -> bool:
    try:
        client.volumes.get(name)
    except Exception:  # noqa: BLE001
        return False
    return True


def wait_exited(client: Any, project: str, count: int, timeout: float, out: TextIO,
                every: float = 2.0) -> Optional[list[dict[str, Any]]]:
    """Poll until the project's `count` containers have all exited; their states,
    or None at the timeout. A container restarting again and again ends the wait."""
    start = last_report = time.monotonic()
    while time.monotonic() - start < timeout:
        states = [container_state(c.attrs) for c in _containers(client, project)]
        done = len(states) >= count and all(s["status"] in ("exited", "dead") for s in states)
        if done or any(s["restarts"] >= 3 for s in states):
            return states
        if time.monotonic() - last_report >= 15:
            last_report = time.monotonic()
            summary = ", ".join(f"{s['service']} {s['status']}" for s in sorted(states, key=lambda s: s["service"]))
            print(f"    {time.monotonic() - start:4.0f} s: {summary}", file=out, flush=True)
        time.sleep(every)
    return None


def _log_text(client: Any, project: str, service: str) -> str:
    for c in _containers(client, project):
        if c.labels.get(cp.LABEL_SERVICE) == service:
            return c.logs(stdout=True, stderr=True).decode("utf-8", "replace")
    return ""


def print_logs(client: Any, project: str, out: TextIO) -> None:
    for c in sorted(_containers(client, project), key=lambda c: c.labels.get(cp.LABEL_SERVICE, c.name)):
        service = c.labels.get(cp.LABEL_SERVICE, c.name)
        print(f"----- logs of {service} ({c.name}) -----", file=out)
        for line in c.logs(stdout=True, stderr=True).decode("utf-8", "replace").splitlines():
            print(f"{service} | {line}", file=out)
    out.flush()


def _remember(tg: Target) -> None:
    RUNS.mkdir(parents=True, exist_ok=True)
    rec = {"project": tg.project.name, "compose_file": tg.project.file, "config": tg.config}
    rd.write_atomic(CURRENT, json.dumps(rec, indent=2) + "\n")


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# --- pure: parsing and judging --------------------------------------------

def container_state(attrs: dict[str, Any]) -> dict[str, Any]:
    """The bits of `docker inspect` that status and smoke use."""
    st = attrs.get("State") or {}
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    return {
        "service": labels.get(cp.LABEL_SERVICE, (attrs.get("Name") or "?").lstrip("/")),
        "status": st.get("Status", "unknown"),
        "exit_code": st.get("ExitCode"),
        "health": (st.get("Health") or {}).get("Status"),
        "restarts": attrs.get("RestartCount", 0) or 0,
    }


def metrics_from_tar(data: bytes) -> dict[str, list[str]]:
    """{file name: lines} of the *.jsonl files in a tar (what get_archive returns)."""
    found: dict[str, list[str]] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.endswith(".jsonl"):
                f = tar.extractfile(m)
                if f is not None:
                    found[Path(m.name).name] = f.read().decode("utf-8", "replace").splitlines()
    return found


def summarize_metrics(lines: Iterable[str]) -> dict[str, Any]:
    """Last step, loss and accuracy in a metrics file; bad or partial lines are skipped."""
    out: dict[str, Any] = {"step": None, "loss": None, "accuracy": None, "event": None}
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        for key in ("step", "loss", "accuracy", "event"):
            if rec.get(key) is not None:
                out[key] = rec[key]
    return out


def status_services(configured: Sequence[sv.Service], containers: Sequence[dict[str, Any]],
                    ) -> list[tuple[sv.Service, Optional[dict[str, Any]]]]:
    """What `status` lists: every container of the project (`docker inspect` attrs),
    described by its own labels and environment, and every configured service that
    has no container (attrs None); one entry per service name, in rank order.

    Of several containers of one service, a one-off (`compose run`) counts only when
    there is no other; among equals, the newest (`Created`) counts."""
    chosen: dict[str, tuple[sv.Service, dict[str, Any]]] = {}
    ranked = sorted(containers, key=lambda a: (not _one_off(a), a.get("Created") or ""))
    for attrs in ranked:  # the best last: it overwrites
        s = sv.from_container(attrs, cp.LABEL_SERVICE)
        if s is not None:
            chosen[s.name] = (s, attrs)
    listed: list[tuple[sv.Service, Optional[dict[str, Any]]]] = list(chosen.values())
    listed += [(s, None) for s in configured if s.name not in chosen]
    return sorted(listed, key=lambda pair: sv.sort_key(pair[0]))


def _one_off(attrs: dict[str, Any]) -> bool:
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    return str(labels.get("com.docker.compose.oneoff", "False")).lower() == "true"


def service_row(service: str, attrs: Optional[dict[str, Any]], metric_lines: list[str]) -> dict[str, Any]:
    row = container_state(attrs) if attrs is not None else {
        "service": service, "status": "no container", "exit_code": None, "health": None, "restarts": 0}
    row["service"] = service
    row.update({k: v for k, v in summarize_metrics(metric_lines).items() if k != "event"})
    return row


def format_status(rows: list[dict[str, Any]]) -> list[str]:
    """One line per service: state, exit code, last step, loss, accuracy."""

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [f"{'SERVICE':<10} {'STATE':<22} {'EXIT':>4} {'STEP':>7} {'LOSS':>8} {'ACCURACY':>8}"]
    for r in rows:
        state = r["status"] + (f" ({r['health']})" if r.get("health") and r["status"] == "running" else "")
        if r.get("restarts"):
            state += f" x{r['restarts']}"
        exit_code = "-" if r["status"] in ("running", "no container", "created") else num(r["exit_code"], "d")
        lines.append(f"{r['service']:<10} {state:<22} {exit_code:>4} {num(r['step'], 'd'):>7} "
                     f"{num(r['loss'], '.4f'):>8} {num(r['accuracy'], '.4f'):>8}")
    return lines


def parse_accuracy(log: str) -> Optional[float]:
    """The PS's final accuracy: the last `Accuracy: X` at the start of a line."""
    found = _ACCURACY.findall(log)
    return float(found[-1]) if found else None


def judge(expected: list[str], states: list[dict[str, Any]], accuracy: Optional[float],
          threshold: float, who: str = "the PS") -> list[str]:
    """What went wrong in a smoke run (empty: it passed); `who` printed the accuracy."""
    problems = []
    by_service = {s["service"]: s for s in states}
    for service in expected:
        s = by_service.get(service)
        if s is None:
            problems.append(f"{service}: no container")
        elif s["status"] not in ("exited", "dead"):
            problems.append(f"{service}: still {s['status']}")
        elif s["exit_code"] != 0:
            problems.append(f"{service}: exit status {s['exit_code']}")
        elif s["restarts"]:
            problems.append(f"{service}: restarted {s['restarts']} time(s)")
    if accuracy is None:
        problems.append(f"{who} printed no `Accuracy:` line")
    elif accuracy < threshold:
        problems.append(f"{who}'s Accuracy {accuracy:.4f} < {threshold:.2f}")
    return problems
