"""The swarm chaos row: a node cut off from the swarm mid-run, then back.

It needs the two-node swarm of `tests/containers/swarm_nodes.sh up IMAGE`
(nodes psc-n1, the manager, and psc-n2, each a dockerd in a network namespace
of its own, linked by the veth pair psc-v1/psc-v2, the image on both); it
talks to node 1's socket itself (DOCKER_HOST is not needed and not changed).
Without that swarm the row is skipped and says so in one line.

The run: the chaos topology as a stack, the PS pinned to psc-n1, the workers
anywhere (Swarm spreads them: some land on psc-n2). Once every worker has
joined, psc-n2's link goes down (`ip -n psc-n2 link set psc-v2 down`) for
longer than the RPC timeout: the PS drops the workers it cannot reach, Swarm
marks the node down and starts their tasks again on psc-n1, where they rejoin
the PS and resume their epochs. Then the link comes back, psc-n2 rejoins the
swarm and its stale tasks are shut down. Recovered: the PS exits 0 at the
accuracy threshold, every service's newest task is complete, and no task is
left running, failing or restarting.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from app.contract import Event
from orchestrator import job_secret
from orchestrator.backends.swarm import adapter
from orchestrator.chaos.common import RUN_TIMEOUT, THRESHOLD, Outcome, Scenario, Timeout, chaos_topology, wait_until
from orchestrator.metrics.records import Record, events, final_accuracy, parse_lines
from orchestrator.paths import ROOT
from orchestrator.render import swarm as render_swarm
from orchestrator.render.yamlio import write_atomic
from orchestrator.topology.model import Topology
from orchestrator.topology.services import PS_SERVICE, service_names

MANAGER, LOST = "psc-n1", "psc-n2"  # hostnames of the harness's nodes
SOCKETS = {MANAGER: "unix:///var/run/docker-n1.sock", LOST: "unix:///var/run/docker-n2.sock"}
LOST_LINK = "psc-v2"  # node 2's end of the veth pair, in its namespace psc-n2
HARNESS = "sudo tests/containers/swarm_nodes.sh up IMAGE"
CUT_MIN = 40.0  # seconds the node stays cut off at least (longer than the topology's RPC timeout)
ANY = "psc-node-loss=any"  # a node label both nodes get: a worker placed there may run on either
CUT_AT_EPOCH = 2  # the cut comes once a worker on node 2 is past this epoch (of 30)
SETTLE = 15.0  # seconds without a new task after the end (longer than the restart delay, 10 s)
ACTIVE = frozenset({"new", "pending", "assigned", "accepted", "preparing", "ready", "starting", "running"})


def node_loss_topology(name: str = "psc-chaos-node-loss") -> Topology:
    """The chaos topology (3 workers, 30 epochs, RPC timeout 10 s) on the cpu-smoke image: the PS
    and worker1 on the manager, worker2 and worker3 on any node (label ANY, on both)."""
    t = chaos_topology()
    place = {"ps": MANAGER, "workers": [MANAGER, ANY, ANY]}
    return t.model_copy(
        update={
            "name": name,
            "image": t.image.model_copy(update={"tag": t.image_tag}),
            "swarm": t.swarm.model_copy(update=place),
        }
    )


def update_node(
    client: Any, hostname: str, *, availability: Optional[str] = None, labels: Optional[dict[str, str]] = None
) -> None:
    """Set a node's availability (active, pause) and add labels."""
    node = next(n for n in client.nodes.list() if n.attrs["Description"]["Hostname"] == hostname)
    spec = dict(node.attrs["Spec"])
    if availability:
        spec["Availability"] = availability
    if labels:
        spec["Labels"] = {**(spec.get("Labels") or {}), **labels}
    node.update(spec)


def missing_harness(image: str) -> Optional[str]:
    """Why the two-node harness is not usable here (None: it is): no swarm of psc-n1 and
    psc-n2 both ready, or `image` missing on one of them."""
    if not os.path.exists(SOCKETS[MANAGER].removeprefix("unix://")):
        return f"needs the two-node swarm ({HARNESS}): no {SOCKETS[MANAGER]}"
    try:
        ready = {n["hostname"] for n in adapter.nodes(node_client(MANAGER)) if n["state"] == "ready"}
        if ready != {MANAGER, LOST}:
            return f"needs the two-node swarm ({HARNESS}): the ready nodes are {sorted(ready)}"
        lacking = [node for node in SOCKETS if not node_client(node).images.list(name=image)]
    except Exception as e:  # noqa: BLE001 - any failure to ask means no harness
        return f"needs the two-node swarm ({HARNESS}): {e}"
    if lacking:
        return f"needs the image {image} on both nodes ({HARNESS}): missing on {', '.join(lacking)}"
    return None


def node_docker(*args: str) -> subprocess.CompletedProcess:
    """The docker CLI against node 1 (the manager), whatever DOCKER_HOST says."""
    return subprocess.run(
        list(args), env={**os.environ, "DOCKER_HOST": SOCKETS[MANAGER]}, capture_output=True, text=True
    )


def node_client(node: str) -> Any:
    import docker

    return docker.DockerClient(base_url=SOCKETS[node], timeout=120)


def set_link(up: bool) -> float:
    """Node 2's link up or down; the wall time it happened."""
    subprocess.run(["ip", "-n", LOST, "link", "set", LOST_LINK, "up" if up else "down"], check=True)
    return time.time()


class DeployFailed(Exception):
    pass


class Stack:
    """One stack on the harness's swarm, read through node 1 (the manager)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.client = node_client(MANAGER)
        self.hostnames = {n.id: n.attrs["Description"]["Hostname"] for n in self.client.nodes.list()}

    def deploy(self, t: Topology, away_from: Optional[str] = None) -> None:
        """A fresh stack of `t` (named `self.name`): whatever was left of it goes first. With
        `away_from`, that node is paused while the tasks are placed: the ones free to run
        anywhere start on the other node (the ones pinned to it wait, then start there)."""
        self.remove()
        if away_from:
            update_node(self.client, away_from, availability="pause")
        try:
            self._deploy(t)
            if away_from:
                wait_until(
                    "the tasks free to move placed",
                    lambda: all(r["node"] != "?" for r in self.tasks() if r["service"] in self.free(t)),
                    60,
                )
        finally:
            if away_from:
                update_node(self.client, away_from, availability="active")

    @staticmethod
    def free(t: Topology) -> list[str]:
        """The workers placed on label ANY (either node)."""
        return [f"worker{i}" for i, node in enumerate(t.worker_nodes(), 1) if node == ANY]

    def _deploy(self, t: Topology) -> None:
        with tempfile.TemporaryDirectory(prefix=f"{self.name}-") as tmp:
            path = Path(tmp) / "stack.yaml"
            write_atomic(path, render_swarm.dump(render_swarm.render(t, data_root=str(ROOT)), t.name))
            # the run's secret, new for each deploy, as stack-up makes it
            adapter.replace_secret(self.client, self.name, render_swarm.secret_name(t), job_secret.new())
            r = node_docker(*adapter.deploy_argv(self.name, str(path)))
            if r.returncode != 0:
                raise DeployFailed(f"docker stack deploy failed: {r.stderr.strip()}")

    def remove(self) -> None:
        """The stack, then its run's secret and its volumes on both nodes (a volume is local to its node)."""
        node_docker(*adapter.rm_argv(self.name))
        adapter.wait_gone(self.client, self.name)
        adapter.remove_secret(self.client, f"{self.name}_{render_swarm.SECRET}")
        for node in SOCKETS:
            for v in node_client(node).volumes.list(filters={"label": f"{adapter.LABEL_STACK}={self.name}"}):
                v.remove(force=True)

    def tasks(self) -> list[dict[str, Any]]:
        """Every task of the stack: service, node hostname, state, desired state, exit code, created."""
        out = []
        for service, svc in adapter.services(self.client, self.name).items():
            for task in svc.tasks():
                status = task.get("Status") or {}
                out.append(
                    {
                        "service": service,
                        "node": self.hostnames.get(task.get("NodeID"), "?"),
                        "state": status.get("State"),
                        "desired": task.get("DesiredState"),
                        "exit": (status.get("ContainerStatus") or {}).get("ExitCode"),
                        "created": task.get("CreatedAt", ""),
                        "id": task["ID"],
                    }
                )
        return sorted(out, key=lambda r: (r["service"], r["created"]))

    def running_on(self, node: str) -> list[str]:
        return sorted({r["service"] for r in self.tasks() if r["node"] == node and r["state"] == "running"})

    def log(self, service: str) -> list[tuple[float, str]]:
        """A service's log (every task) as (wall time, line)."""
        svc = adapter.services(self.client, self.name).get(service)
        if svc is None:
            return []
        raw = b"".join(self.client.api.service_logs(svc.id, stdout=True, stderr=True, timestamps=True))
        out = []
        for line in raw.decode("utf-8", "replace").splitlines():
            m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z?)\s(.*)$", line)
            if m:  # not the daemon's own lines ("error from daemon ...": a node out of reach)
                out.append((stamp(m.group(1)), m.group(2)))
        return out

    def records(self, service: str, event: Event, since: float = 0.0, node: str = MANAGER) -> list[Record]:
        """A service's `event` records written at or after `since`, from its metrics file as
        its containers on `node` see it (the PS is pinned to the manager; a worker's is on
        the node it runs on, readable while that node is reachable)."""
        lines = adapter.read_metrics(node_client(node), self.name, service).get(f"{service}.jsonl", [])
        return events(parse_lines(lines), event, since)


def stamp(text: str) -> float:
    """Docker's RFC 3339 timestamp (nanoseconds) -> wall time."""
    head, _, frac = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + (float(f"0.{frac}") if frac else 0.0)


def settled(stack: Stack, expected: list[str]) -> Optional[list[dict[str, Any]]]:
    """Every service's newest task ended and no task is active anywhere; the tasks, or None."""
    tasks = stack.tasks()
    newest = {r["service"]: r for r in tasks}
    if set(newest) != set(expected) or any(r["state"] in ACTIVE for r in tasks):
        return None
    return tasks


def node_loss(run_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """Cut node 2 off mid-run for longer than the RPC timeout, then restore it."""
    out = Outcome(f"node {LOST} cut off from the swarm mid-run, then back")
    t = t or node_loss_topology()
    reason = missing_harness(t.image_tag)
    if reason is not None:
        out.skipped, out.notes = True, reason
        return out
    stack = Stack(render_swarm.stack_name(t))
    expected = service_names(t)
    lost: list[str] = []
    try:
        start = time.time()
        lost = _deploy_and_find_lost(stack, t, [s for s in expected if s != PS_SERVICE])
        if not lost:
            out.notes = f"no worker task on {LOST} (Swarm put them all on {MANAGER}): nothing to lose"
            return out
        cut, back = _cut_off(stack, lost, out)
        _judge(stack, expected, out, cut, back, start)
        out.notes = (
            f"{', '.join(lost)} on {LOST}: running again on {MANAGER} after "
            f"{out.details['reschedule_s']:.1f} s, rejoined the PS after {out.recovered_s:.1f} s; "
            f"link down {out.details['cut_s']:.0f} s, {LOST} ready {out.details['node_back_s']:.1f} s "
            f"after it came back; {'every task complete, none restarting' if out.recovered else 'NOT settled'}"
        )
        return out
    except (Timeout, DeployFailed) as error:
        out.notes = str(error)
        return out
    finally:
        _keep_logs(stack, expected, run_dir)
        if lost:
            set_link(up=True)  # idempotent: the node must never stay cut off
        stack.remove()


def _deploy_and_find_lost(stack: Stack, t: Topology, workers: list[str]) -> list[str]:
    """Deploy away from the manager; once every worker joined, the workers running on LOST
    (each past CUT_AT_EPOCH when there are any)."""
    for node in SOCKETS:
        update_node(stack.client, node, labels=dict([ANY.split("=", 1)]))
    stack.deploy(t, away_from=MANAGER)
    wait_until(
        "every worker joined the PS", lambda: len(stack.records(PS_SERVICE, Event.JOIN)) >= len(workers), RUN_TIMEOUT
    )
    lost = [s for s in wait_until(f"a worker running on {LOST}", lambda: stack.running_on(LOST), 30) if s in workers]
    if lost:
        wait_until(
            f"{lost[0]} past epoch {CUT_AT_EPOCH}",
            lambda: any(r.get("epoch", 0) > CUT_AT_EPOCH for r in stack.records(lost[0], Event.TRAIN, node=LOST)),
            RUN_TIMEOUT,
        )
    return lost


def _cut_off(stack: Stack, lost: list[str], out: Outcome) -> tuple[float, float]:
    """LOST's link down until the lost workers run again on the manager and rejoined the PS
    (at least CUT_MIN s), then up; (when it went down, when it came back)."""
    out.details["placement"] = {r["service"]: r["node"] for r in stack.tasks()}
    cut = set_link(up=False)
    try:

        def moved() -> bool:
            nodes = {r["service"]: r for r in stack.tasks()}  # newest task of each service
            return all(nodes[s]["node"] == MANAGER and nodes[s]["state"] == "running" for s in lost)

        wait_until(f"{', '.join(lost)} running again on {MANAGER}", moved, RUN_TIMEOUT)
        out.details["reschedule_s"] = round(time.time() - cut, 1)

        def rejoined() -> list[Record]:
            joins = stack.records(PS_SERVICE, Event.JOIN, cut)
            return joins if len(joins) >= len(lost) else []

        rejoin = wait_until("the moved workers rejoin the PS", rejoined, RUN_TIMEOUT)
        out.recovered_s = out.details["rejoin_s"] = round(max(r["time"] for r in rejoin) - cut, 1)
        out.details["rejoined"] = [r.get("worker") for r in rejoin]
        time.sleep(max(0.0, cut + CUT_MIN - time.time()))
    finally:
        back = set_link(up=True)
    return cut, back


def _judge(stack: Stack, expected: list[str], out: Outcome, cut: float, back: float, start: float) -> None:
    """After the link is back: LOST ready again, every task ended (and none retried after
    SETTLE s); recovered when every task completed and the accuracy holds."""
    drops = stack.records(PS_SERVICE, Event.DROP, cut)
    out.detected_s = round(drops[0]["time"] - cut, 1) if drops else None
    out.details["cut_s"] = round(back - cut, 1)
    wait_until(
        f"{LOST} ready again",
        lambda: LOST in {n["hostname"] for n in adapter.nodes(stack.client) if n["state"] == "ready"},
        RUN_TIMEOUT,
    )
    out.details["node_back_s"] = round(time.time() - back, 1)
    final = wait_until("every task ended, none active", lambda: settled(stack, expected), RUN_TIMEOUT)
    time.sleep(SETTLE)  # a failed task's retry would show up now
    again = settled(stack, expected)
    out.details["tasks"] = again or stack.tasks()
    out.details["run_s"] = round(time.time() - start, 1)
    out.accuracy = final_accuracy(stack.records(PS_SERVICE, Event.END))
    newest = {r["service"]: r for r in (again or final)}
    ps_ok = newest[PS_SERVICE]["state"] == "complete"
    all_complete = all(r["state"] == "complete" for r in newest.values())
    out.recovered = bool(
        again and len(again) == len(final) and ps_ok and all_complete and (out.accuracy or 0) >= THRESHOLD
    )


def _keep_logs(stack: Stack, expected: list[str], run_dir: Path) -> None:
    """Every service's log into run_dir/stack.log (a help: a failure to read it is written instead)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        (run_dir / "stack.log").write_text(
            "".join(f"----- {s}\n" + "".join(f"{ts:.3f} {line}\n" for ts, line in stack.log(s)) for s in expected),
            encoding="utf-8",
        )
    except Exception as e:  # noqa: BLE001 - the logs are a help, the clean-up after them is a must
        (run_dir / "stack.log").write_text(f"cannot read the logs: {e}\n", encoding="utf-8")


SCENARIOS: dict[str, Scenario] = {
    "swarm-node-loss": node_loss,
}
