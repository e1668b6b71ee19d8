"""The soak's pure parts that come before any container: its plan from a seed, the job it
sizes, the compose document it runs, and its place in the CLI (orchestrator/chaos/soak_plan.py,
soak.py, soak_job.py, registry.py)."""

from __future__ import annotations

import io
import re

import pytest

from orchestrator import cli
from orchestrator.chaos import registry, soak, soak_plan
from orchestrator.chaos.common import chaos_topology
from orchestrator.chaos.soak import soak_topology
from orchestrator.chaos.soak_checks import Audit, FaultResult, Row
from orchestrator.chaos.soak_faults import Context
from orchestrator.chaos.soak_job import size_limited, workers_limited
from orchestrator.render import compose


def test_the_same_seed_gives_the_same_plan_and_another_seed_another():
    assert soak_plan.first(42, 40) == soak_plan.first(42, 40)
    assert soak_plan.first(42, 40) != soak_plan.first(43, 40)


def test_each_round_injects_every_kind_once_after_pauses_in_range():
    steps = soak_plan.first(7, 5 * len(soak_plan.KINDS))
    for start in range(0, len(steps), len(soak_plan.KINDS)):
        round_ = steps[start : start + len(soak_plan.KINDS)]
        assert sorted(s.kind for s in round_) == sorted(soak_plan.KINDS)
    assert all(soak_plan.PAUSE_S[0] <= s.pause_s <= soak_plan.PAUSE_S[1] for s in steps)
    assert all(0 <= s.pick < 1 for s in steps)
    fills = [s.hold_s for s in steps if s.kind == "fill"]
    assert fills and all(soak_plan.FILL_HOLD_S[0] <= h <= soak_plan.FILL_HOLD_S[1] for h in fills)
    # the rounds are shuffled: not every round in the same order
    orders = {tuple(s.kind for s in steps[i : i + len(soak_plan.KINDS)]) for i in range(0, len(steps), 8)}
    assert len(orders) > 1


def test_a_pick_names_the_same_target_whatever_the_order_of_the_candidates():
    assert soak_plan.choose(["worker2", "worker1"], 0.0) == "worker1"
    assert soak_plan.choose(["worker1", "worker2"], 0.99) == "worker2"
    assert soak_plan.choose(["worker2"], 0.7) == "worker2"


@pytest.mark.parametrize("pick", [0.0, 0.3, 0.5, 0.99])
def test_a_scale_grows_above_the_count_and_never_past_the_most(pick):
    assert 3 <= soak_plan.scale_to(2, 4, pick) <= 4
    assert soak_plan.scale_to(2, 3, pick) == 3


def test_the_soak_topology_gives_every_kind_of_fault_a_target_and_outlives_the_soak():
    t = soak_topology(3)
    assert t.ps.shards == 2  # shard-kill
    assert t.max_workers > t.workers.count  # scale
    assert t.ps.rpc_timeout <= 10  # pause: the drop comes within seconds
    assert t.train.epochs == soak_plan.job_epochs(3, soak.EPOCHS_PER_MINUTE)
    assert soak_topology(10).train.epochs > t.train.epochs
    assert soak_topology(3, epochs=5).train.epochs == 5


def test_the_state_volume_is_a_tmpfs_of_the_size_asked_owned_by_the_app_user():
    doc = size_limited(compose.render(soak_topology(1)), 64)
    volume = doc["volumes"]["state"]
    assert volume["driver"] == "local"
    assert volume["driver_opts"] == {"type": "tmpfs", "device": "tmpfs", "o": "size=64m,uid=1000,gid=1000"}
    assert volume["labels"]  # the render's labels are kept
    assert "driver_opts" not in compose.render(soak_topology(1))["volumes"]["state"]  # the input is not changed


def test_the_soak_holds_each_worker_to_its_cpus_the_scaled_ones_too_and_nothing_else():
    rendered = compose.render(soak_topology(1))
    doc = workers_limited(rendered, 0.2)
    held = {name: s["cpus"] for name, s in doc["services"].items() if "cpus" in s}
    assert held == {"worker1": 0.2, "worker2": 0.2, "worker3": 0.2, "worker4": 0.2}
    assert not any("cpus" in s for s in rendered["services"].values())  # the input is not changed
    assert workers_limited(rendered, None) == rendered


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_soak_runs_alone_and_in_containers_else_one_line_and_exit_2(capsys):
    code, text = run_cli(capsys, "chaos", "soak", "worker-kill")
    assert code == 2 and text.strip().count("\n") == 0 and "soak runs alone" in text
    code, text = run_cli(capsys, "chaos", "soak", "--no-containers")
    assert code == 2 and "soak runs alone and in containers" in text
    code, text = run_cli(capsys, "chaos", "soak", "--minutes", "0")
    assert code == 2 and "--minutes: got 0; must be a number > 0" in text
    code, text = run_cli(capsys, "chaos", "soak", "--seed", "x")
    assert code == 2 and "--seed" in text


def test_the_soak_is_a_known_name_of_the_chaos_registry(capsys):
    assert "soak" in registry.LONG_RUNS and set(registry.LONG_RUNS) == set(registry.long_runs())
    code, text = run_cli(capsys, "chaos", "no-such-scenario", "--no-containers")
    assert code == 2 and "soak" in text


def test_each_soak_is_a_project_of_its_own_on_the_smoke_image():
    """A soak never shares a project (its cluster, its volume) with another soak on the engine."""
    names = {soak_topology(1).name for _ in range(20)}
    assert len(names) == 20 and all(re.fullmatch(r"psc-soak-[0-9a-f]{6}", n) for n in names)
    assert soak_topology(1, project="psc-mine").name == "psc-mine"
    assert soak_topology(1).image_tag == chaos_topology().image_tag == "ps-compose-cpu-smoke:latest"


def test_seeds_and_seed_are_one_or_the_other_and_name_and_seeds_are_the_soaks(capsys):
    code, text = run_cli(capsys, "chaos", "soak", "--seeds", "2", "--seed", "7")
    assert code == 2 and text.count("\n") == 1 and "not allowed with argument" in text
    code, text = run_cli(capsys, "chaos", "soak", "--seeds", "0")
    assert code == 2 and "--seeds: got 0; must be at least 1" in text
    code, text = run_cli(capsys, "chaos", "worker-kill", "--no-containers", "--seeds", "2")
    assert code == 2 and text == "chaos: --seeds, --faults and --name are for soak only\n"
    assert set(registry.series()) == set(registry.LONG_RUNS)


def test_the_table_of_several_seeds_has_a_row_each_naming_what_failed():
    held = [Row("the run finished", True, "end"), Row("final accuracy >= 0.90", True, "0.97")]
    failed = [Row("the run finished", True, "end"), Row("every container exited 0", False, "worker4 exited 143")]
    lines = soak.seeds_table([soak.SeedResult(590333, 9, held), soak.SeedResult(777, 8, failed)])
    assert [line.split()[:5] for line in lines] == [
        ["SEED", "FAULTS", "HELD", "FAILED", "RESULT"],
        ["590333", "9", "2", "0", "pass"],
        ["777", "8", "1", "1", "FAIL:"],
    ]
    assert lines[2].endswith("FAIL: every container exited 0")
    assert soak.SeedResult(777, 8, failed).code == 1 and soak.SeedResult(1, 1, held).code == 0


class _Job:
    """The soak's job as `inject` sees it: a PS that runs, and an audit after each fault."""

    def states(self):
        return {"ps": {"status": "running"}}

    def audit(self):
        return Audit(0.0, {})


def _inject(monkeypatch, minutes: float, faults: int) -> list[str]:
    """The kinds `inject` strikes with faults that recover at once and pauses of no time."""
    monkeypatch.setattr(soak.time, "sleep", lambda seconds: None)
    for kind in soak_plan.KINDS:
        monkeypatch.setitem(soak.FAULTS, kind, lambda job, step, ctx: FaultResult(step.kind, "x", 0.0, 1.0))
    seen = soak.Observed(7, minutes, faults, ctx=Context(2, 4, 10.0, 240.0))
    soak.inject(_Job(), seen, io.StringIO())
    return [r.kind for r in seen.results]


def test_with_faults_n_the_soak_strikes_at_least_n_faults_however_short_its_minutes(monkeypatch):
    """A slow host's recoveries can take a soak's whole minutes: `--faults N` still strikes N,
    each kind once before any is repeated."""
    assert _inject(monkeypatch, minutes=1e-6, faults=0) == []
    kinds = _inject(monkeypatch, minutes=1e-6, faults=3)
    assert kinds == [s.kind for s in soak_plan.first(7, 3)] and len(set(kinds)) == 3


def test_faults_is_the_soaks_option(capsys):
    code, text = run_cli(capsys, "chaos", "worker-kill", "--no-containers", "--faults", "3")
    assert code == 2 and text == "chaos: --seeds, --faults and --name are for soak only\n"
    code, text = run_cli(capsys, "chaos", "soak", "--faults", "0")
    assert code == 2 and "--faults: got 0; must be at least 1" in text
