"""The topology's `env`: names of the caller's variables that the PS and every worker get. The
rendered files hold the names only, never a value; a bad name is one line and exit 2."""

from __future__ import annotations

import pytest
import yaml

from orchestrator.render import compose as render_compose
from orchestrator.render import kubernetes as render_kubernetes
from orchestrator.render import swarm as render_swarm
from orchestrator.topology.model import validate

from orch_helpers import topology

SECRET = "s3cr3t-value-never-rendered"


def test_each_name_reaches_every_process_by_name_and_no_value_is_rendered(monkeypatch, schema_validator) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    t = validate(topology(env=["HF_TOKEN", "BUCKET_KEY"]), "t.yaml")
    doc = render_compose.render(t)
    for name, svc in doc["services"].items():
        if name.startswith(("ps", "worker")):
            assert svc["environment"]["HF_TOKEN"] is None and svc["environment"]["BUCKET_KEY"] is None, name
    text = render_compose.dump(doc, t.name)
    assert SECRET not in text and "HF_TOKEN:" in text
    schema_validator.validate(yaml.safe_load(text))  # compose's "from the caller" form
    stack = render_swarm.dump(render_swarm.render(t, data_root="/data"), t.name)
    assert SECRET not in stack and "HF_TOKEN:" in stack
    pods = render_kubernetes.dump(render_kubernetes.render(t, data_root="/data"), t.name)
    assert SECRET not in pods
    assert "secretKeyRef" in pods and f"name: {t.name}-env" in pods and "key: HF_TOKEN" in pods


@pytest.mark.parametrize(
    "names, why",
    [
        (["1TOKEN"], "must be a variable's name"),
        (["PSC_LR"], "PSC_ is the app's own"),
        (["PYTHONPATH"], "the render sets it"),
        (["A", "A"], "a name is given twice"),
    ],
)
def test_a_bad_name_is_one_line_and_exit_2(cli, write_config, names, why) -> None:
    status, out, err = cli("render", "-c", str(write_config(topology(env=names))), "-o", "-")
    assert status == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "env" in err and why in err, err


def test_a_name_the_caller_has_not_set_is_said_once() -> None:
    t = validate(topology(env=["HF_TOKEN", "BUCKET_KEY"]), "t.yaml")
    assert t.env_unset({"HF_TOKEN": "x"}) == "env: BUCKET_KEY not set here: the job's processes will not have it"
    assert t.env_unset({"HF_TOKEN": "x", "BUCKET_KEY": ""}) is None
