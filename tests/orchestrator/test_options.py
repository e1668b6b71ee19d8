"""One declaration per option (app/options.py), read by the app's parser, the topology model,
the render's environment and docs/topology.md: these tests fail when any of them disagree.

The strongest of them is the round trip: a topology giving every training option a value
other than the app's default, rendered, read back by the app's own parser, gives the
same values."""

from __future__ import annotations

import typing

import pytest

from app.config import parse
from app.option_table import OPTIONS, in_topology
from app.options import ALWAYS, CHANGED
from orchestrator.render import compose as render_compose
from orchestrator.topology.messages import section_fields
from orchestrator.topology.model import parse as parse_topology
from orchestrator.topology.option_sections import PS, Train

from orch_helpers import REPO

SMOKE = (REPO / "configs/cpu-smoke.yaml").read_text()
TOPOLOGY_OPTIONS = [o for o in OPTIONS if o.topology]
MODELS = {"train": Train, "ps": PS}

# A value other than the app's default for every training option, valid together
# (ssp takes staleness, staleness_lr and overlap; cpu for bf16; imagefolder for image_size).
OTHER = {
    "model": "resnet34",
    "dataset": "imagefolder",
    "eval_data": "https://host/val-{0..1}.tar",
    "batch_size": 7,
    "lr": 0.25,
    "momentum": 0.5,
    "epochs": 3,
    "max_steps": 9,
    "strategy": "ssp",
    "staleness": 2,
    "staleness_lr": True,
    "overlap": True,
    "local_steps": 8,  # diloco's and diloco_async's, taken (and unused) under ssp
    "outer_optimizer": {"name": "sgd", "lr": 0.5},
    "compress": "bf16",
    "seed": 5,
    "eval_batch_size": 128,
    "eval_every": 11,
    "log_every": 3,
    "loader_workers": 2,
    "rpc_timeout": 61,
    "join_timeout": 301,
    "checkpoint_every": 17,
    "shards": 2,
    "image_size": 64,
    "image_cache": "file",
    "precision": "bf16",
    "channels_last": True,
    "weight_decay": 0.001,
    "optimizer": {"name": "rmsprop", "alpha": 0.9},
    "schedule": {"name": "cosine", "warmup": 0.1, "eta_min": 0.001},
    "clip_grad_norm": 1.5,
    "cuda_graphs": True,
    "loss": {"name": "cross_entropy", "label_smoothing": 0.1},
    "metrics": "perplexity",
}


def environment(t) -> dict[str, str]:
    return render_compose.app_environment(
        t,
        1,
        master_addr="ps",
        master_port=29500,
        data_dir="/data",
        checkpoint_dir="/state/c",
        metrics_dir="/state/m",
        ifname="eth0",
        cache_dir="/state/cache",
    )


def every_option_changed():
    train = {o.key: OTHER[o.name] for o in in_topology("train")}
    ps = {o.key: OTHER[o.name] for o in in_topology("ps")}
    return parse_topology(
        _yaml(
            name="t",
            image={"base": "b", "device": "cpu"},
            workers={"count": 2},
            train=dict(train, data_dir="/srv/data"),
            ps=ps,
        ),
        "t.yaml",
    )


def _yaml(**doc) -> str:
    import yaml

    return yaml.safe_dump(doc)


def test_every_training_option_has_a_value_in_the_round_trip() -> None:
    assert set(OTHER) == {o.name for o in TOPOLOGY_OPTIONS}
    # (imagefolder is the app's default dataset: image_size and the cache are imagefolder's)
    assert [o.name for o in TOPOLOGY_OPTIONS if OTHER[o.name] == o.default] == ["dataset"]


def test_topology_render_and_parser_agree_on_every_value() -> None:
    """The four sides agree: the topology takes the value, the render writes it under the
    option's variable, the app's parser reads it back as the same value."""
    t = every_option_changed()
    env = environment(t)
    config = parse(["worker"], env)
    for o in TOPOLOGY_OPTIONS:
        value = getattr(getattr(t, o.section), o.key)
        assert value == OTHER[o.name], o.name
        assert env[o.env] == o.text(value), o.name
        assert getattr(config, o.name) == value, o.name


def test_the_topology_fields_are_the_declarations() -> None:
    for o in TOPOLOGY_OPTIONS:
        field = section_fields(MODELS[o.section])[o.key]
        assert field.description == o.help, o.name
        assert field.is_required() == o.required, o.name
        if not o.required:
            assert field.get_default(call_default_factory=True) == o.default, o.name
        if o.choices:
            literal = next(
                a
                for a in [field.annotation, *typing.get_args(field.annotation)]
                if typing.get_origin(a) is typing.Literal
            )
            assert typing.get_args(literal) == o.choices, o.name


@pytest.mark.parametrize(
    "o", [o for o in TOPOLOGY_OPTIONS if o.low is not None or o.high is not None], ids=lambda o: o.name
)
def test_a_bound_is_the_same_on_both_sides(o) -> None:
    """Just past a bound, the topology refuses the value and so does the app's parser."""
    bad = o.low - (0 if o.low_open else 1) if o.low is not None else o.high + (0 if o.high_open else 1)
    bad = int(bad) if o.kind == "int" else float(bad)
    doc = dict(
        name="t",
        image={"base": "b", "device": "cpu"},
        workers={"count": 2},
        train={"model": "cnn", "dataset": "digits", "batch_size": 8, "lr": 0.1, "epochs": 1},
    )
    doc.setdefault(o.section, {})[o.key] = bad
    with pytest.raises(Exception, match=f"{o.section}.{o.key}"):
        parse_topology(_yaml(**doc), "t.yaml")
    with pytest.raises(Exception, match=o.env):
        parse(["worker"], {o.env: o.text(bad)})


def test_the_render_passes_on_always_options_and_changed_ones_only_when_changed() -> None:
    t = parse_topology(SMOKE, "c.yaml")
    env = environment(t)
    for o in TOPOLOGY_OPTIONS:
        value = getattr(getattr(t, o.section), o.key)
        if o.emit == ALWAYS:
            assert env[o.env] == o.text(value), o.name
        else:
            assert o.emit == CHANGED and (o.env in env) == (value != o.default), o.name


def test_docs_topology_md_has_a_row_per_option_with_its_help() -> None:
    text = (REPO / "docs/topology.md").read_text(encoding="utf-8")
    for o in TOPOLOGY_OPTIONS:
        row = next((line for line in text.splitlines() if line.startswith(f"| `{o.topology}` |")), None)
        assert row is not None and o.help in row, o.name


def test_the_apps_help_names_every_flag_and_variable(capsys) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"], {})
    out = capsys.readouterr().out
    for o in OPTIONS:
        assert o.flag in out and o.env in out, o.name


def test_a_value_from_the_environment_is_named_by_its_variable() -> None:
    with pytest.raises(Exception, match=r"^PSC_HOST_WORKERS: 0 must be >= 1$"):
        parse(["worker"], {"PSC_HOST_WORKERS": "0"})
    with pytest.raises(Exception, match=r"^--host_workers: 0 must be >= 1$"):
        parse(["worker", "--host_workers", "0"], {})


def test_a_kubernetes_index_gives_the_rank_and_the_shard() -> None:
    assert parse(["worker"], {"JOB_COMPLETION_INDEX": "2", "PSC_WORLD_SIZE": "4"}).rank == 3
    assert parse(["worker", "--rank", "1"], {"JOB_COMPLETION_INDEX": "2", "PSC_WORLD_SIZE": "4"}).rank == 1
    assert parse(["ps"], {"JOB_COMPLETION_INDEX": "1", "PSC_SHARDS": "2"}).shard == 1
    with pytest.raises(Exception, match="JOB_COMPLETION_INDEX: 'x'"):
        parse(["worker"], {"JOB_COMPLETION_INDEX": "x"})
