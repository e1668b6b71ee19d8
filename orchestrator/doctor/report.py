"""doctor's report: one line per check, the summary, and the one-line refusal with
which `up` and `stack-up` start nothing."""

from __future__ import annotations

from typing import TextIO

from orchestrator.doctor.checks import Check
from orchestrator.errors import UsageError


def summary(checks: list[Check]) -> str:
    """`N checks passed`, and the checks not run by name: never counted as passed."""
    passed = sum(c.passed for c in checks)
    not_run = [c.name for c in checks if c.not_run]
    return f"{passed} checks passed" + (f", {len(not_run)} not run ({', '.join(not_run)})" if not_run else "")


def report(checks: list[Check], out: TextIO) -> bool:
    """Print one line per check and a summary; True when no check found a problem or was
    skipped (a check not run, e.g. the probe under --no-probe, is listed as such, not passed)."""
    for c in checks:
        print(c.line(), file=out)
    problems = sum(c.ok is False for c in checks)
    skipped = sum(c.ok is None for c in checks)
    not_run = sum(c.not_run for c in checks)
    if problems or skipped:
        print(
            f"doctor: {problems} problem(s), {skipped} not checked, {sum(c.passed for c in checks)} ok"
            + (f", {not_run} not run" if not_run else ""),
            file=out,
        )
    elif not_run:
        print(f"doctor: {summary(checks)}", file=out)
    else:
        print(f"doctor: all {len(checks)} checks passed", file=out)
    out.flush()
    return not problems and not skipped


def stop_on_problems(checks: list[Check], config: str, hint: str, target: str = "") -> None:
    """UsageError naming the first problem (one line) when a check did not pass; `target`:
    the --target the full doctor command needs (none for the default)."""
    bad = [c for c in checks if c.ok is False]
    if not bad:
        return
    first = bad[0]
    doctor = f"python -m orchestrator doctor -c {config}" + (f" --target {target}" if target else "")
    more = f" (and {len(bad) - 1} more: {doctor})" if len(bad) > 1 else ""
    raise UsageError(f"{config}: {first.text} ({first.fix}){more}; nothing was started.{' ' + hint if hint else ''}")
