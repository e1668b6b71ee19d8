"""Strategy allreduce in real containers: the cpu-smoke topology as a DDP job of
2 workers (no PS), through `orchestrator smoke --strategy allreduce`; then a
worker that crashes mid-run and a job that resumes. Own project names, torn
down before and after."""

import io
import re
import time

import pytest

from orchestrator import paths
from orchestrator.backends.compose import adapter as compose_adapter
from orchestrator.backends.compose.app_signal import KILL_APP
from orchestrator.backends.registry import get
from orchestrator.paths import ROOT
from orchestrator.verbs import cluster as verbs
from orchestrator.verbs import smoke as smoke_verb

pytestmark = [pytest.mark.slow, pytest.mark.docker]

CONFIG = f"{ROOT}/configs/cpu-smoke.yaml"
PROJECT = "psc-test-allreduce"


def test_allreduce_smoke_in_containers(engine, offline_image):
    out = io.StringIO()
    status = smoke_verb.smoke(get("compose"), CONFIG, 2, strategy="allreduce", name=PROJECT, timeout=300, out=out)
    text = out.getvalue()
    print(text[-5000:])
    assert status == 0, text[-5000:]
    assert f"project {PROJECT}, 2 workers (allreduce, no ps)" in text
    m = re.search(
        r"^smoke: passed: Accuracy ([0-9.]+) >= 0.90; 2 containers exited 0 \(worker1, worker2\)$", text, re.MULTILINE
    )
    assert m and float(m.group(1)) >= 0.90, text[-3000:]
    assert engine.containers.list(all=True, filters={"label": f"{compose_adapter.LABEL_PROJECT}={PROJECT}"}) == []


def _containers(engine, project):
    return {
        c.labels[compose_adapter.LABEL_SERVICE]: c
        for c in engine.containers.list(all=True, filters={"label": f"{compose_adapter.LABEL_PROJECT}={project}"})
    }


def test_a_crashed_worker_restarts_and_the_job_resumes(engine, offline_image, tmp_path, monkeypatch, capfd):
    """`up` of a longer run; the app in worker2 is SIGKILLed (a crash: Docker restarts it);
    worker1 loses its peer, exits 1 with one line and is restarted too; the job resumes
    from worker1's checkpoint and ends; `status` and `logs` show it."""
    monkeypatch.setattr(paths, "RUNS", tmp_path)  # nothing of the user's runs/ is touched
    config = tmp_path / "long.yaml"
    config.write_text(open(CONFIG).read().replace("epochs: 10", "epochs: 40"))
    project = f"{PROJECT}-crash"
    kw = dict(name=project, strategy="allreduce")
    verbs.down(get("compose"), str(config), 2, volumes=True, **kw)
    try:
        assert verbs.up(get("compose"), str(config), 2, remember=False, out=io.StringIO(), **kw) == 0
        deadline = time.monotonic() + 120
        while "checkpoint ckpt-" not in _containers(engine, project)["worker1"].logs().decode():
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.5)
        _containers(engine, project)["worker2"].exec_run(["python", "-c", KILL_APP])
        states = compose_adapter.wait_exited(engine, project, 2, timeout=180, out=io.StringIO())
        if states is None or any(s.exit_code != 0 for s in states):
            logs = io.StringIO()
            compose_adapter.print_logs(engine, project, logs)
            pytest.fail(f"the job did not end well within 180 s: {states}\n{logs.getvalue()[-6000:]}")
        capfd.readouterr()

        out = io.StringIO()
        assert verbs.status(get("compose"), str(config), 2, out=out, **kw) == 0
        rows = {line.split()[0]: line.split() for line in out.getvalue().splitlines()[2:]}
        assert sorted(rows) == ["worker1", "worker2"], out.getvalue()
        for row in rows.values():
            assert row[1:4] == ["exited", "x1", "0"], out.getvalue()  # each restarted once, then done
            assert int(row[4]) == 40 * 22  # 40 epochs of 22 steps: every rank took every step
        assert float(rows["worker1"][6]) >= 0.90 and rows["worker2"][6] == "-"  # rank 0 evaluates
        assert verbs.logs(get("compose"), str(config), 2, follow=False, **kw) == 0
        logs = capfd.readouterr().out
        assert re.search(r"^worker1[-_]1\s+\| .* ERROR app: worker1 failed: PeerLost: lost a peer", logs, re.M), logs
        assert re.search(r"^worker1[-_]1\s+\| .* resumed from /state/checkpoints/ckpt-", logs, re.M), logs
        assert re.search(r"^worker2[-_]1\s+\| worker2 \| Epoch: 40 \| Batch: 22 \| Loss: ", logs, re.M), logs
        assert re.search(r"^worker1[-_]1\s+\| Accuracy: 0\.\d{4}$", logs, re.M), logs
    finally:
        verbs.down(get("compose"), str(config), 2, volumes=True, **kw)
