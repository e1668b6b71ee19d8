"""A 3-minute chaos soak in real containers (orchestrator/chaos/soak.py): random faults from a
random seed (printed, so that a failure can be replayed with `--seed`), then every row of the
invariants table passes, and the soak did inject faults of several kinds."""

from __future__ import annotations

import io
import json
import sys

import pytest

from orchestrator.chaos import soak

pytestmark = [pytest.mark.slow, pytest.mark.docker]


class Tee(io.StringIO):
    """Kept for the assertion's message, and shown as it goes (CI's log)."""

    def write(self, text: str) -> int:
        sys.__stdout__.write(text)
        return super().write(text)


@pytest.mark.timeout(1800)  # 3 minutes of faults, the job's end (a few minutes more), the image
def test_a_three_minute_soak_keeps_every_invariant(docker_engine, tmp_path):
    out = Tee()
    code = soak.run(3, None, tmp_path, out=out)

    text = out.getvalue()
    found = json.loads((tmp_path / "soak.json").read_text())
    failed = [f"{r['invariant']}: {r['evidence']}" for r in found["invariants"] if not r["passed"]]
    assert not failed and code == 0, f"seed {found['seed']}: {failed}\n{text}"
    invariants = {r["invariant"] for r in found["invariants"]}
    assert {
        "the run finished",
        "after each PS restart, versions continue from the newest checkpoint",
        "no checkpoint lost",
        "final accuracy >= 0.90",
        "every container exited 0",
        "nothing left in the job's /dev/shm",
        "no temporary file in the state volume",
        "nothing left on the engine after down -v",
    } <= invariants
    injected = [f for f in found["faults"] if not f["skipped"]]
    # 3 minutes hold about one round of the 8 kinds (each fault recovers in 4-25 s on a 2-core CPU VM)
    assert len({f["kind"] for f in injected}) >= 5, text
    assert found["audits"] >= len(injected) + 2
