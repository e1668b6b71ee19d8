"""doctor as the tests call it: a check by its name for a target, found in that target's
backend (orchestrator/backends/registry.py), so every test goes through the list a
target really runs; Facts with the target's own facts (compose, stack_cli, nodes, kubectl,
manifests) routed under `target`."""

from __future__ import annotations

from typing import Any

from orchestrator.backends import registry
from orchestrator.doctor import checks as _checks
from orchestrator.doctor.checks import Check  # noqa: F401 - used by the tests through this module
from orchestrator.doctor.facts import Facts as _Facts
from orchestrator.doctor.facts import data_path, dir_problem, port_in_use  # noqa: F401
from orchestrator.doctor.probe import PROBE_MARK, PROBE_SCRIPT, parse_probe  # noqa: F401
from orchestrator.doctor.report import report, stop_on_problems, summary  # noqa: F401

TARGET_KEYS = ("compose", "compose_error", "stack_cli", "nodes", "kubectl", "manifests")
ALIASES = {"client": ("check_compose", "check_stack_cli", "check_kubectl")}


def Facts(**kw: Any) -> _Facts:
    target = {k: kw.pop(k) for k in TARGET_KEYS if k in kw}
    return _Facts(**kw, target=target)


def run_checks(t, target: str, f: _Facts) -> list[Check]:
    return _checks.run_checks(registry.get(target).checks(), t, f)


def find(name: str, target: str):
    """The check called check_NAME in `target`'s list (a partial counts by its function)."""
    wanted = ALIASES.get(name, (f"check_{name}",))
    for check in registry.get(target).checks():
        fn = getattr(check, "func", check)
        if fn.__name__ in wanted:
            return check
    raise LookupError(f"target {target} has no check {name}")


def _by_name(name: str):
    def call(t, target: str, f: _Facts) -> Check:
        return find(name, target)(t, f)

    call.__name__ = f"check_{name}"
    return call


check_daemon = _by_name("daemon")
check_client = _by_name("client")
check_nvidia = _by_name("nvidia")
check_gpus = _by_name("gpus")
check_probe = _by_name("probe")
check_shm = _by_name("shm")
check_data = _by_name("data")
check_disk = _by_name("disk")
check_port = _by_name("port")
check_swarm = _by_name("swarm")
check_placement = _by_name("placement")
check_state = _by_name("state")
