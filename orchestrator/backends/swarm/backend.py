"""The swarm target: `docker stack deploy` on one or more hosts (render:
orchestrator/render/swarm.py; the command lines and the SDK reads: backends/swarm/adapter.py;
the verbs on top of these blocks, named stack-*: orchestrator/verbs/cluster.py).

A stack's tasks are one-shot: a service has ended when its newest task has; `stack rm`
returns before the containers and the network are gone, so `remove` waits for them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional, TextIO

from orchestrator import images, job_secret
from orchestrator.backends import export_container
from orchestrator.backends.base import EVERY_LINE, Backend, Cluster, LogLines, LogOptions, ServiceState
from orchestrator.backends.command import run
from orchestrator.backends.lines import ProcessLines
from orchestrator.backends.swarm import adapter, doctor
from orchestrator.doctor.facts import Facts
from orchestrator.errors import EngineError
from orchestrator.paths import ROOT
from orchestrator.render import swarm
from orchestrator.topology.model import Topology
from orchestrator.topology.services import describe, order

# A stack's event files are on the PS's node; no service there shows them (yet).
SWARM_REFUSAL = (
    "stack-tensorboard: not done for a swarm stack: its event files are on the state volume of the PS's node; "
    "there, `python -m tensorboard.main --logdir <that volume>/metrics/tensorboard` shows them"
)

GONE_TIMEOUT = 120.0  # seconds `stack rm` has to remove the stack's containers and network


class SwarmBackend(Backend):
    name = "swarm"
    output = "stack.yaml"
    doctor = doctor
    noun = "stack"
    summary = "swarm (docker stack deploy, one or more hosts)"
    verb_prefix = "stack-"
    smoke_timeout = 600
    record = "stack.json"
    unit = "task"
    missing = "no task"
    task_table = True
    removed = "removed (services, containers, network)"
    volume_where = " on each node"
    ended_well = "complete, exit 0, no retry"
    image_note = (
        "on this node; every node that runs a task needs it (docs/multi-host.md: docker save | ssh NODE docker load)"
    )
    verb_help = {
        "up": "doctor, render runs/<name>/stack.yaml, build if missing, docker stack deploy",
        "down": "docker stack rm, and wait until its containers and network are gone",
        "logs": "every service's log (docker service logs), following until every task has ended",
        "status": "one line per service: its newest task's state, exit code, retries",
        "smoke": "the CPU topology as a swarm stack: accuracy and every task's exit state",
        "scale": "not on Swarm yet: refused with one line (scale runs on compose)",
        "tensorboard": "refused, with the one line that says why (docs/reports.md)",
        "export": "the run's trained model to runs/NAME/model/, from the state volume on this node (the PS's)",
    }
    refusals = {
        "scale": "stack-scale: a running stack is not scaled yet (its workers are not rendered beyond "
        "workers.count); stop it (stack-down) and deploy again with the new count: it resumes from "
        "its last checkpoint",
        "tensorboard": SWARM_REFUSAL,
    }

    def render(self, t: Topology, data_root: str) -> str:
        # A relative train.data_dir is taken from `data_root` (absolute in the stack file).
        return swarm.dump(swarm.render(t, data_root=data_root), t.name, t.overrides)

    def document(self, t: Topology, facts: Optional[Facts] = None) -> str:
        """The stack file for this swarm: its node count from the doctor's facts, else asked."""
        nodes = len(doctor.nodes(facts)) if facts is not None else _node_count()
        return swarm.dump(swarm.render(t, data_root=str(ROOT), nodes=nodes), t.name, t.overrides)

    def name_of(self, t: Topology) -> str:
        return swarm.stack_name(t)

    def deploy(self, c: Cluster, env: dict[str, str], out: TextIO) -> list[str]:
        what = f": {describe(c.topology)}" if c.topology is not None else ""
        print(f"==> deploying stack {c.name}{what}", file=out, flush=True)
        # The run's secret, new for each deploy; only the stack's tasks are given it.
        adapter.replace_secret(images.client(), c.name, f"{c.name}_{swarm.SECRET}", job_secret.new())
        r = run(adapter.deploy_argv(c.name, str(c.file)), capture=True, env=env)
        return [f"docker stack deploy: {line}" for line in adapter.ignored_options(r.stdout + r.stderr)]

    def describe(self, c: Cluster) -> list[ServiceState]:
        return list(adapter.states(images.client(), c.name).values())

    def log_iter(self, c: Cluster, follow: bool, options: LogOptions = EVERY_LINE) -> LogLines:
        """Every service's log at once (`docker service logs` each), prefixed by task and node."""
        names = order(adapter.services(images.client(), c.name), c.topology)
        if not names:
            raise EngineError(f"no stack {c.name} (make stack-up first)")
        return ProcessLines([adapter.logs_argv(c.name, s, follow=follow, extra=options.flags()) for s in names])

    def remove(self, c: Cluster, volumes: bool) -> None:
        client = images.client()
        run(adapter.rm_argv(c.name), capture=True, check=False)
        left = adapter.wait_gone(client, c.name, timeout=GONE_TIMEOUT)
        if left:
            raise EngineError(f"stack {c.name}: still there after {GONE_TIMEOUT:.0f} s: {', '.join(left)}")
        adapter.remove_secret(client, f"{c.name}_{swarm.SECRET}")
        if volumes:
            adapter.remove_volumes(client, c.name)

    def export_model(self, c: Cluster, run_id: str, into: Path) -> None:
        export_container.export(images.client(), c.file, c.name, run_id, into, ROOT)

    def read_records(self, c: Cluster, service: str) -> dict[str, list[str]]:
        return adapter.read_metrics(images.client(), c.name, service)

    def running_env(self, c: Cluster, names: Sequence[str]) -> dict[str, str]:
        return adapter.running_env(images.client(), c.name, names)


def _node_count() -> int:
    """How many nodes the swarm has; 0 when this engine cannot tell (not a manager: the
    deploy then says so)."""
    try:
        return len(adapter.nodes(images.client()))
    except Exception:  # noqa: BLE001 - docker.errors.APIError and the like
        return 0


BACKEND = SwarmBackend()
