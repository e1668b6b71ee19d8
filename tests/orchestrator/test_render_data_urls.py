"""The render of data that lives elsewhere: a URL data_dir is not mounted and reaches the app as
given; s3:// data gives every process the AWS_* names (never values); a local shard pattern
mounts its folder."""

from __future__ import annotations

import pytest
import yaml

from app.contract import S3_ENV
from orchestrator.render import compose as render_compose
from orchestrator.render import kubernetes as render_kubernetes
from orchestrator.render import swarm as render_swarm
from orchestrator.topology.model import TopologyError, parse

from orch_helpers import topology, training


def _topology(**train):
    job = {"dataset": "webdataset", "max_steps": 50, "image_size": 16, **train}
    return parse(yaml.safe_dump(topology(train=job)), "t.yaml")


def test_a_url_data_dir_is_not_mounted_and_reaches_every_process_as_given():
    t = _topology(data_dir="https://host/train-{000000..000003}.tar", eval_data="https://host/val-{0..1}.tar")
    for name, svc in training(render_compose.render(t)).items():
        assert svc["environment"]["PSC_DATA_DIR"] == "https://host/train-{000000..000003}.tar", name
        assert svc["environment"]["PSC_EVAL_DATA"] == "https://host/val-{0..1}.tar", name
        assert not [v for v in svc["volumes"] if v["target"] in (render_compose.DATA_DIR, render_compose.EVAL_DIR)]
        if name != "ps":  # (the PS has MLflow's AWS_* names for an artifact store)
            assert not [k for k in svc["environment"] if k.startswith("AWS_")]  # http: no credentials asked for


def test_s3_data_gives_the_ps_and_every_worker_the_aws_names_never_their_values():
    t = _topology(data_dir="s3://bucket/train-{0..3}.tar", eval_data="s3://bucket/val.tar")
    services = training(render_compose.render(t))
    assert {"ps", "worker1", "worker2"} <= set(services)
    for svc in services.values():
        assert {name: svc["environment"][name] for name in S3_ENV} == dict.fromkeys(S3_ENV)  # null: the caller's
    stack = render_swarm.render(t, data_root="/srv/run")
    assert all(stack["services"][name]["environment"]["AWS_ACCESS_KEY_ID"] is None for name in ("ps", "worker1"))
    for doc in render_kubernetes.render(t, data_root="/srv/run"):
        if doc["kind"] == "Job":
            env = doc["spec"]["template"]["spec"]["containers"][0]["env"]
            refs = {
                e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
                for e in env
                if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
            }
            assert {name: refs.get(name) for name in S3_ENV} == {name: name for name in S3_ENV}
            assert not [v for v in doc["spec"]["template"]["spec"]["volumes"] if v["name"] == "data"]


def test_a_local_shard_pattern_mounts_its_folder_and_names_the_pattern_inside():
    t = _topology(data_dir="./shards/train-{0..3}.tar", eval_data="./held-out/val-{0..1}.tar")
    ps = render_compose.render(t)["services"]["ps"]
    mounts = {v["target"]: v["source"] for v in ps["volumes"] if v["type"] == "bind"}
    assert mounts[render_compose.DATA_DIR] == "./shards" and mounts[render_compose.EVAL_DIR] == "./held-out"
    assert ps["environment"]["PSC_DATA_DIR"] == "/data/train-{0..3}.tar"
    assert ps["environment"]["PSC_EVAL_DATA"] == "/data-eval/val-{0..1}.tar"
    assert ps["environment"]["PSC_IMAGE_SIZE"] == "16"  # webdataset crops as imagefolder does


def test_the_aws_names_join_the_topologys_env_once():
    doc = topology(
        train={"dataset": "webdataset", "max_steps": 5, "data_dir": "s3://b/t.tar", "eval_data": "s3://b/v.tar"}
    )
    doc["env"] = ["HF_TOKEN", "AWS_ACCESS_KEY_ID"]
    t = parse(yaml.safe_dump(doc), "t.yaml")
    assert t.job_env() == ["HF_TOKEN", "AWS_ACCESS_KEY_ID", *[n for n in S3_ENV if n != "AWS_ACCESS_KEY_ID"]]
    worker = render_compose.render(t)["services"]["worker1"]["environment"]
    assert worker["HF_TOKEN"] is None and all(worker[name] is None for name in S3_ENV)


@pytest.mark.parametrize(
    "train, said",
    [
        (
            {"data_dir": "ftp://host/t-{0..1}.tar", "eval_data": "https://host/v.tar"},
            "train.data_dir: got 'ftp://host/t-{0..1}.tar'; a URL's scheme must be http://, https://, s3://, not ftp://",
        ),
        (
            {"data_dir": "s3://b/t.tar", "eval_data": "gs://b/v.tar"},
            "train.eval_data: got 'gs://b/v.tar'; a URL's scheme must be http://, https://, s3://, not gs://",
        ),
        (
            {"dataset": "imagefolder", "data_dir": "https://host/imagenette"},
            "train.data_dir: got 'https://host/imagenette'; dataset imagefolder reads a local directory (a URL: "
            "webdataset or your own)",
        ),
    ],
    ids=["ftp", "gs-eval", "imagefolder-url"],
)
def test_a_url_the_job_cannot_read_is_one_line_at_the_render(train, said):
    with pytest.raises(TopologyError) as error:
        _topology(**train)
    assert str(error.value) == f"t.yaml: {said}"
