"""The soak's invariants judged on recorded records (orchestrator/chaos/soak_checks.py): each
passes on a run that kept it and fails, naming the evidence, on one that broke it."""

from __future__ import annotations

from typing import Any

from orchestrator.chaos import soak_checks as checks
from orchestrator.chaos.soak_checks import Audit, FaultResult, Shm


def rec(time: float, event: str, step: int, **fields: Any) -> dict[str, Any]:
    """A record as the PS's MetricsWriter writes it."""
    return {"time": time, "role": "ps", "rank": 0, "event": event, "step": step, **fields}


def ck(version: int, digest: str = "0123456789abcdef") -> str:
    return f"ckpt-{version:08d}-{digest}.pt"


def ps_run(*restarts: tuple[float, int]) -> list[dict[str, Any]]:
    """Checkpoints at 200, 400, 600 (t = 2, 4, 6), then the given (time, version) PS restarts."""
    records = [rec(0, "start", 0)]
    records += [rec(v / 100, "checkpoint", v, file=ck(v), why="every 200 updates") for v in (200, 400, 600)]
    records += [rec(t, "start", v) for t, v in restarts]
    return sorted(records, key=lambda r: r["time"])


def test_a_restart_that_resumes_the_newest_checkpoint_or_newer_passes():
    row = checks.resumes_continue(ps_run((5.0, 400), (7.0, 612)), corrupted=set())
    assert row.passed and row.evidence == "2 restarts, at versions 400 (newest 400), 612 (newest 600)"


def test_a_restart_from_an_older_checkpoint_fails_naming_both_versions():
    row = checks.resumes_continue(ps_run((7.0, 400)), corrupted=set())
    assert not row.passed
    assert row.evidence == "a restart at version 400, the newest checkpoint before it is 600"
    assert not checks.resumes_continue(ps_run((7.0, 0)), corrupted=set()).passed  # a run begun again


def test_a_checkpoint_the_soak_damaged_is_not_expected_back():
    row = checks.resumes_continue(ps_run((7.0, 400)), corrupted={ck(600)})
    assert row.passed, row


def test_no_restart_is_said_so():
    row = checks.resumes_continue(ps_run(), corrupted=set())
    assert row.passed and row.evidence == "no PS restart in this soak"


def test_checkpoints_there_or_superseded_by_a_newer_valid_one_are_kept():
    records = ps_run()
    audits = [
        Audit(4.5, {ck(200): True, ck(400): True}),
        Audit(9.0, {ck(400): True, ck(600): True, ck(800, "fedcba9876543210"): True}),  # 200 pruned, superseded
    ]
    row = checks.checkpoints_kept(records, audits, corrupted=set())
    assert row.passed and row.evidence == "3 written, each there or superseded at all 2 audits"


def test_a_logged_checkpoint_missing_with_nothing_newer_is_lost():
    row = checks.checkpoints_kept(ps_run(), [Audit(9.0, {ck(200): True, ck(400): True})], corrupted=set())
    assert not row.passed and row.evidence == f"{ck(600)} missing with no newer valid one (seen at 9)"


def test_a_damaged_checkpoint_is_lost_unless_the_soak_damaged_it():
    audits = [Audit(9.0, {ck(200): True, ck(400): True, ck(600): False})]
    row = checks.checkpoints_kept(ps_run(), audits, corrupted=set())
    assert not row.passed and row.evidence == f"{ck(600)} damaged (seen at 9)"
    row = checks.checkpoints_kept(ps_run(), audits, corrupted={ck(600)})
    assert row.passed and row.evidence.endswith("1 damaged by the soak, skipped")


def test_a_checkpoint_logged_after_an_audit_is_not_judged_by_it():
    row = checks.checkpoints_kept(ps_run(), [Audit(3.0, {ck(200): True})], corrupted=set())
    assert row.passed


def test_the_run_finished_needs_the_end_record_final_pt_and_exit_0():
    records = ps_run() + [rec(10, "end", 900, accuracy=0.9805)]
    assert checks.run_finished(records, Audit(11, {}, final=True), 0).passed
    assert not checks.run_finished(records, Audit(11, {}, final=False), 0).passed
    assert not checks.run_finished(records, Audit(11, {}, final=True), 1).passed
    row = checks.run_finished(ps_run(), Audit(11, {}, final=True), 0)
    assert not row.passed and row.evidence.startswith("no end record")


def test_the_final_accuracy_is_the_last_end_record_s():
    records = [rec(10, "end", 900, accuracy=0.5), rec(20, "end", 950, accuracy=0.9805)]
    row = checks.accuracy(records, 0.90)
    assert row.passed and row.evidence == "0.9805" and row.invariant == "final accuracy >= 0.90"
    assert not checks.accuracy([rec(10, "end", 900, accuracy=0.85)], 0.90).passed
    assert not checks.accuracy([], 0.90).passed


def state(status: str = "exited", code: int = 0, restarts: int = 0) -> dict[str, Any]:
    return {"status": status, "exit_code": code, "restarts": restarts}


def test_every_container_exited_0_the_scaled_ones_too():
    states = {"ps": state(restarts=2), "worker1": state(restarts=3), "worker3": state(), "pidns": state()}
    row = checks.containers_exited(states, scaled={"worker3"})
    assert row.passed
    assert row.evidence == "4 containers exited 0 (worker3 stopped by a scale down); Docker restarted them 5 times"
    row = checks.containers_exited({**states, "worker2": state(code=1), "ps-shard1": state("restarting", 1)}, set())
    assert not row.passed and row.evidence == "ps-shard1: restarting, exit 1; worker2: exited, exit 1"
    assert not checks.containers_exited({}, set()).passed


def test_every_injected_fault_must_recover_and_a_skipped_one_does_not_count():
    ok = FaultResult("worker-kill", "worker1", 0.0, recovered_s=3.5)
    skipped = FaultResult("pause", "-", 0.0, skipped="no worker running")
    assert checks.faults_recovered([ok, skipped]).evidence == "1 of 1 faults"
    lost = FaultResult("ps-kill", "ps", 0.0, notes="the PS did not start again within 240 s")
    row = checks.faults_recovered([ok, lost])
    assert not row.passed and row.evidence == "ps-kill ps: the PS did not start again within 240 s"
    assert not checks.faults_recovered([skipped]).passed  # a soak that injected nothing proves nothing


def test_a_fill_that_restarted_a_container_fails_naming_it():
    """The soak's fill fault once restarted the PS, the shard and the workers (an event file's
    OSError ended each) and still counted as recovered: this row fails on it."""
    calm = FaultResult("fill", "the state volume", 1.0, recovered_s=3.0, details={"restarted": []})
    crashed = FaultResult("fill", "the state volume", 9.0, recovered_s=4.0, details={"restarted": ["ps", "worker1"]})
    assert checks.full_volume_restarts_none([calm]).passed
    assert checks.full_volume_restarts_none([calm]).evidence == "1 fill, no container restarted"
    row = checks.full_volume_restarts_none([calm, crashed])
    assert not row.passed and row.evidence == "Docker restarted ps, worker1 while the volume was full or after"
    skipped = FaultResult("fill", "the state volume", 1.0, skipped="no room")
    assert checks.full_volume_restarts_none([skipped]).evidence == "no fill in this soak"


def test_segment_observations_pass_when_seen_and_held_and_say_when_not_seen():
    results = [
        FaultResult("worker-kill", "worker1", 0.0, segment_reused=True),
        FaultResult("ps-kill", "ps", 0.0, segment_gone=True),
        FaultResult("shard-kill", "ps-shard1", 0.0, segment_gone=False),
    ]
    reused, gone = checks.segment_rows(results)
    assert reused.passed and reused.evidence == "1 of 1 worker restarts"
    assert not gone.passed and gone.evidence == "shard-kill ps-shard1"
    unseen = checks.segment_rows([])
    assert all(r.passed and r.evidence.startswith("not observed") for r in unseen)


def proc(pid: int, role: str, rank: str = "", shard: str = "0", maps: Any = ()) -> dict[str, Any]:
    """An app process as soak_probes.shm reports it."""
    return {"pid": pid, "role": role, "rank": rank, "shard": shard, "maps": None if maps is None else list(maps)}


PS_SEG, SHARD_SEG, NEW_SEG = "/dev/shm/psc-10-aa.shm", "/dev/shm/psc-11-bb.shm", "/dev/shm/psc-40-cc.shm"
BEFORE = Shm(
    ["psc-10-aa.shm", "psc-11-bb.shm"],
    [
        proc(10, "ps", maps=[PS_SEG]),
        proc(11, "ps", shard="1", maps=[SHARD_SEG]),
        proc(12, "worker", rank="1", maps=[PS_SEG, SHARD_SEG, "/dev/shm/other"]),
        proc(13, "worker", rank="2", maps=None),  # its /proc could not be read
    ],
)


def test_a_process_is_found_by_its_service_with_the_segments_it_maps():
    assert BEFORE.process("ps") == (10, frozenset({PS_SEG}))
    assert BEFORE.process("ps-shard1") == (11, frozenset({SHARD_SEG}))
    assert BEFORE.process("worker1") == (12, frozenset({PS_SEG, SHARD_SEG}))  # only the PS's segments
    assert BEFORE.process("worker2") is None and BEFORE.process("worker3") is None


def test_a_restarted_worker_that_maps_the_same_segments_reused_its_slots():
    before = BEFORE.process("worker1")
    assert before is not None
    same = Shm(BEFORE.files, [proc(10, "ps", maps=[PS_SEG]), proc(50, "worker", rank="1", maps=[PS_SEG, SHARD_SEG])])
    assert checks.restarted(before, same, "worker1") and checks.slot_reused(before, same, "worker1")
    other = Shm(BEFORE.files, [proc(50, "worker", rank="1", maps=[NEW_SEG, SHARD_SEG])])
    assert not checks.slot_reused(before, other, "worker1")
    assert not checks.restarted(before, BEFORE, "worker1")  # the same process: not restarted yet
    starting = Shm(BEFORE.files, [proc(50, "worker", rank="1", maps=[])])
    assert not checks.restarted(before, starting, "worker1")  # a new process that maps nothing yet


def test_a_killed_ps_segment_must_be_gone_and_its_successor_s_there():
    before = BEFORE.process("ps")
    assert before is not None
    swept = Shm(["psc-11-bb.shm", "psc-40-cc.shm"], [proc(40, "ps", maps=[NEW_SEG])])
    assert checks.segment_replaced(before, swept, "ps")
    left = Shm(["psc-10-aa.shm", "psc-11-bb.shm", "psc-40-cc.shm"], [proc(40, "ps", maps=[NEW_SEG])])
    assert not checks.segment_replaced(before, left, "ps")  # the old one is still there
    assert not checks.segment_replaced(before, BEFORE, "ps")  # no successor yet


def test_dev_shm_at_the_end_holds_only_segments_of_live_ps_processes():
    assert checks.shm_at_end(None).passed
    assert checks.shm_at_end(Shm(["other-file"], [])).evidence == "after the PS exited: no psc-* file"
    live = checks.shm_at_end(Shm(["psc-11-bb.shm"], [proc(11, "ps", shard="1", maps=[SHARD_SEG])]))
    assert live.passed and live.evidence == "after the PS exited: 1 segment(s) of PS processes still running"
    stray = checks.shm_at_end(Shm(["psc-9-aa.shm", ".psc-10-bb.making"], [proc(12, "worker", "1", maps=[PS_SEG])]))
    assert not stray.passed and stray.evidence == "stray: psc-9-aa.shm, .psc-10-bb.making"


def test_nothing_left_names_what_was_left():
    clean, engine = checks.nothing_left({"containers": [], "volumes": [], "networks": []}, Audit(0, {}))
    assert clean.passed and engine.passed
    temp, engine = checks.nothing_left(
        {"containers": ["psc-soak-keeper"], "volumes": ["psc-soak_state"], "networks": []},
        Audit(0, {}, temp=["/state/checkpoints/.ckpt-00000200-0123456789abcdef.pt.12.tmp"]),
    )
    assert not temp.passed and temp.evidence == "/state/checkpoints/.ckpt-00000200-0123456789abcdef.pt.12.tmp"
    assert not engine.passed and engine.evidence == "containers: psc-soak-keeper; volumes: psc-soak_state"


def test_the_fault_table_gives_each_kind_its_count_median_and_worst():
    results = [
        FaultResult("ps-kill", "ps", 0.0, recovered_s=10.0),
        FaultResult("ps-kill", "ps", 0.0, recovered_s=20.0),
        FaultResult("ps-kill", "ps", 0.0, recovered_s=12.0),
        FaultResult("ps-kill", "ps", 0.0),  # not recovered: counted as injected only
        FaultResult("pause", "-", 0.0, skipped="no worker running"),
    ]
    summary = {kind: rest for kind, *rest in checks.fault_summary(results)}
    assert summary["ps-kill"] == [4, 3, "12.0", "20.0"]
    assert summary["pause"] == [0, 0, "-", "-"]
    lines = checks.fault_table(results)
    assert lines[0].split() == ["FAULT", "INJECTED", "RECOVERED", "MEDIAN", "WORST"]
    assert lines[3].split() == ["ps-kill", "4", "3", "12.0", "s", "20.0", "s"]
    assert len(lines) == 1 + len(summary)


def test_the_invariant_table_lines_up_its_columns():
    rows = [checks.Row("the run finished", True, "end"), checks.Row("no checkpoint lost", False, "x missing")]
    lines = checks.invariant_table(rows)
    assert [line.index("pass" if i == 1 else "FAIL" if i == 2 else "RESULT") for i, line in enumerate(lines)] == [
        len("no checkpoint lost  ")
    ] * 3
