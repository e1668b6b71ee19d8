"""The soak's invariants, judged on what it recorded (pure): the PS's metrics records, the
checkpoint audits taken along the way, the faults' outcomes and the containers' end states.
Each check gives one row of the table: the invariant, pass or FAIL, and its evidence.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from app.contract import Event
from orchestrator.chaos.soak_plan import KINDS
from orchestrator.metrics.records import Record, events

CHECKPOINT_NAME = re.compile(r"^ckpt-(\d+)-[0-9a-f]{16}\.pt$")
SEGMENT_PREFIX = "psc-"  # the PS's segments in /dev/shm (app.exchange.segment)


@dataclass
class Audit:
    """The state volume at one moment: the PS's checkpoint files (name -> its bytes match the
    digest in its name), the temporary files anywhere in it, and whether final.pt is there."""

    time: float
    files: dict[str, bool]
    temp: list[str] = field(default_factory=list)
    final: bool = False


@dataclass
class Shm:
    """The job's /dev/shm at one moment (its files) and its app processes (pid, role, rank,
    shard, and the /dev/shm files each maps; maps None where /proc could not be read)."""

    files: list[str]
    procs: list[dict[str, Any]]

    @staticmethod
    def service_of(proc: dict[str, Any]) -> str:
        if proc["role"] == "ps":
            return "ps" if str(proc["shard"]) in ("", "0") else f"ps-shard{proc['shard']}"
        return f"worker{proc['rank']}"

    def process(self, service: str) -> Optional[tuple[int, frozenset[str]]]:
        """(pid, the segments it maps) of `service`'s app process (its first: a DataLoader child
        maps what its parent does); None when it has none, or its maps could not be read."""
        found = sorted((p["pid"], p["maps"]) for p in self.procs if self.service_of(p) == service)
        if not found or found[0][1] is None:
            return None
        return found[0][0], frozenset(m for m in found[0][1] if m.rsplit("/", 1)[-1].startswith(SEGMENT_PREFIX))

    def segments(self) -> list[str]:
        """The PS segments in /dev/shm, whole or being made."""
        return [f for f in self.files if f.startswith(SEGMENT_PREFIX) or f.startswith(f".{SEGMENT_PREFIX}")]


def restarted(before: tuple[int, frozenset[str]], now: Optional[Shm], service: str) -> bool:
    """`service` runs a new process (another pid) that maps a segment already."""
    found = now.process(service) if now is not None else None
    return found is not None and found[0] != before[0] and bool(found[1])


def slot_reused(before: tuple[int, frozenset[str]], after: Shm, service: str) -> bool:
    """A restarted worker maps the same segments as its killed process did (its rank's slots are in them)."""
    found = after.process(service)
    return found is not None and found[1] == before[1]


def segment_replaced(before: tuple[int, frozenset[str]], after: Shm, service: str) -> bool:
    """A killed PS process's segment is gone from /dev/shm, and its successor's is there."""
    found = after.process(service)
    if found is None or not found[1] or found[1] == before[1]:
        return False
    names = set(after.files)
    return all(p.rsplit("/", 1)[-1] not in names for p in before[1]) and all(
        p.rsplit("/", 1)[-1] in names for p in found[1]
    )


@dataclass
class FaultResult:
    """One injected fault and how the job came back from it."""

    kind: str
    target: str
    start: float  # unix time of the injection
    recovered_s: Optional[float] = None  # injection -> the job whole and training again (None: not seen)
    detected_s: Optional[float] = None  # injection -> the PS noticed (a drop, a lost shard...)
    notes: str = ""
    skipped: str = ""  # nothing was injected: why (no target)
    corrupted: str = ""  # the checkpoint file the soak damaged
    segment_gone: Optional[bool] = None  # a killed PS process's segment was removed by its successor
    segment_reused: Optional[bool] = None  # a restarted worker maps the same segment (its rank's slots)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    invariant: str
    passed: bool
    evidence: str


def version_of(name: str) -> Optional[int]:
    m = CHECKPOINT_NAME.match(name)
    return int(m.group(1)) if m else None


def _newest_checkpoint(ps: list[Record], before: float, corrupted: set[str]) -> Optional[Record]:
    """The newest checkpoint the PS logged before `before` that the soak did not damage."""
    found = [r for r in events(ps, Event.CHECKPOINT) if r["time"] <= before and r.get("file") not in corrupted]
    return max(found, key=lambda r: r["time"]) if found else None


def resumes_continue(ps: list[Record], corrupted: set[str]) -> Row:
    """After each PS restart the versions continue from the newest checkpoint written before it
    (or a newer one whose record the kill cut off), never from an older one."""
    wrong, resumed = [], []
    for start in events(ps, Event.START)[1:]:
        newest = _newest_checkpoint(ps, start["time"], corrupted)
        expected = newest["step"] if newest else 0
        resumed.append(f"{start['step']} (newest {expected})")
        if start["step"] < expected:
            wrong.append(f"a restart at version {start['step']}, the newest checkpoint before it is {expected}")
    name = "after each PS restart, versions continue from the newest checkpoint"
    if wrong:
        return Row(name, False, "; ".join(wrong))
    if not resumed:
        return Row(name, True, "no PS restart in this soak")
    return Row(name, True, f"{len(resumed)} restarts, at versions {', '.join(resumed)}")


def checkpoints_kept(ps: list[Record], audits: list[Audit], corrupted: set[str]) -> Row:
    """At every audit, each checkpoint the PS logged as written (and the soak did not damage) is
    there with its bytes intact, or a valid checkpoint of a version as new or newer is."""
    lost: list[str] = []
    written = events(ps, Event.CHECKPOINT)
    for audit in audits:
        valid = [v for n, ok in audit.files.items() if ok and (v := version_of(n)) is not None]
        for r in written:
            name = r.get("file", "")
            if r["time"] > audit.time or name in corrupted or audit.files.get(name):
                continue
            if name in audit.files:
                lost.append(f"{name} damaged (seen at {audit.time:.0f})")
            elif not any(v >= r["step"] for v in valid):
                lost.append(f"{name} missing with no newer valid one (seen at {audit.time:.0f})")
    name = "no checkpoint lost"
    if lost:
        return Row(name, False, "; ".join(sorted(set(lost))[:5]))
    damaged = f"; {len(corrupted)} damaged by the soak, skipped" if corrupted else ""
    return Row(name, True, f"{len(written)} written, each there or superseded at all {len(audits)} audits{damaged}")


def run_finished(ps: list[Record], final: Audit, ps_exit: Optional[int]) -> Row:
    ends = events(ps, Event.END)
    ok = bool(ends) and final.final and ps_exit == 0
    end = f"end record at version {ends[-1]['step']}" if ends else "no end record"
    return Row(
        "the run finished",
        ok,
        f"{end}; final.pt {'present' if final.final else 'MISSING'}; the PS exited {ps_exit}",
    )


def accuracy(ps: list[Record], threshold: float) -> Row:
    ends = [r for r in events(ps, Event.END) if isinstance(r.get("accuracy"), (int, float))]
    value = float(ends[-1]["accuracy"]) if ends else None
    shown = "none" if value is None else f"{value:.4f}"
    return Row(f"final accuracy >= {threshold:.2f}", value is not None and value >= threshold, shown)


def containers_exited(states: dict[str, dict[str, Any]], scaled: set[str]) -> Row:
    """Every container of the project exited 0 (the workers a scale stopped too)."""
    bad = [
        f"{s}: {v['status']}, exit {v['exit_code']}"
        for s, v in sorted(states.items())
        if v["status"] != "exited" or v["exit_code"] != 0
    ]
    restarts = sum(v.get("restarts", 0) for v in states.values())
    stopped = sorted(scaled & set(states))
    by_scale = f" ({', '.join(stopped)} stopped by a scale down)" if stopped else ""
    evidence = (
        "; ".join(bad)
        if bad
        else f"{len(states)} containers exited 0{by_scale}; Docker restarted them {restarts} times"
    )
    return Row("every container exited 0", bool(states) and not bad, evidence)


def faults_recovered(results: list[FaultResult]) -> Row:
    done = [r for r in results if not r.skipped]
    missing = [f"{r.kind} {r.target}: {r.notes}" for r in done if r.recovered_s is None]
    evidence = "; ".join(missing[:4]) if missing else f"{len(done)} of {len(done)} faults"
    return Row("every fault recovered", bool(done) and not missing, evidence)


def full_volume_restarts_none(results: list[FaultResult]) -> Row:
    """A state volume that filled up restarted no container: the app says a file that does not
    fit in one line and goes on (the fill fault notes which ones Docker restarted meanwhile)."""
    name = "a full state volume restarts no process"
    fills = [r for r in results if r.kind == "fill" and not r.skipped]
    if not fills:
        return Row(name, True, "no fill in this soak")
    restarted = sorted({s for r in fills for s in r.details.get("restarted", [])})
    if restarted:
        return Row(name, False, f"Docker restarted {', '.join(restarted)} while the volume was full or after")
    return Row(name, True, f"{len(fills)} fill{'s' if len(fills) != 1 else ''}, no container restarted")


def segment_rows(results: list[FaultResult]) -> list[Row]:
    """The shared-memory exchange through the faults, where the soak could observe it."""
    rows = []
    for attr, name, what in (
        ("segment_reused", "a restarted worker maps its rank's slot in the same segment", "worker restarts"),
        ("segment_gone", "a killed PS's segment is removed by its successor", "PS and shard kills"),
    ):
        seen = [r for r in results if getattr(r, attr) is not None]
        bad = [f"{r.kind} {r.target}" for r in seen if not getattr(r, attr)]
        if not seen:
            rows.append(Row(name, True, f"not observed: no {what} with a segment in this soak"))
        else:
            rows.append(Row(name, not bad, "; ".join(bad) if bad else f"{len(seen)} of {len(seen)} {what}"))
    return rows


def shm_at_end(shm: Optional[Shm]) -> Row:
    """/dev/shm once the PS had exited: no segment but those a PS process still running maps,
    or the namespace gone with its holder."""
    name = "nothing left in the job's /dev/shm"
    if shm is None:
        return Row(name, True, "the IPC namespace ended with its holder (nothing can be left in it)")
    live = {m.rsplit("/", 1)[-1] for p in shm.procs if p["role"] == "ps" for m in p["maps"] or ()}
    stray = [f for f in shm.segments() if f not in live]
    left = shm.segments()
    shown = f"{len(left)} segment(s) of PS processes still running" if left else "no psc-* file"
    return Row(name, not stray, f"stray: {', '.join(stray)}" if stray else f"after the PS exited: {shown}")


def nothing_left(leftovers: dict[str, list[str]], final: Audit) -> list[Row]:
    engine = [f"{k}: {', '.join(v)}" for k, v in leftovers.items() if v]
    return [
        Row(
            "no temporary file in the state volume",
            not final.temp,
            ", ".join(final.temp) if final.temp else "none at the end",
        ),
        Row(
            "nothing left on the engine after down -v",
            not engine,
            "; ".join(engine) if engine else "no container (keeper included), volume or network",
        ),
    ]


def fault_summary(results: list[FaultResult]) -> list[tuple[str, int, int, str, str]]:
    """(kind, injected, recovered, median s, worst s) per kind, in KINDS order."""
    out = []
    for kind in KINDS:
        done = [r for r in results if r.kind == kind and not r.skipped]
        times = [r.recovered_s for r in done if r.recovered_s is not None]
        median = f"{statistics.median(times):.1f}" if times else "-"
        worst = f"{max(times):.1f}" if times else "-"
        out.append((kind, len(done), len(times), median, worst))
    return out


def columns(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Rows as aligned text; the last column is not padded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def invariant_table(rows: list[Row]) -> list[str]:
    return columns(
        [("INVARIANT", "RESULT", "EVIDENCE")]
        + [(r.invariant, "pass" if r.passed else "FAIL", r.evidence) for r in rows]
    )


def fault_table(results: list[FaultResult]) -> list[str]:
    head = ("FAULT", "INJECTED", "RECOVERED", "MEDIAN", "WORST")
    body = [
        (k, str(n), str(ok), f"{m} s" if m != "-" else m, f"{w} s" if w != "-" else w)
        for k, n, ok, m, w in fault_summary(results)
    ]
    return columns([head, *body])
