"""KEY=VALUE overrides on the command line (issue 58), Hydra's way: dotted keys, YAML values,
validated exactly as the file is (one line naming the key, the value and what is allowed; exit
2; nothing written), recorded in the rendered file's header and the run's record."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from orchestrator.backends import record
from orchestrator.backends.base import Cluster
from orchestrator.backends.registry import get
from orchestrator.errors import UsageError
from orchestrator.topology import overrides
from orchestrator.topology.messages import near
from orchestrator.topology.model import TopologyError, load, load_with, parse

from orch_helpers import REPO, topology

SMOKE = str(REPO / "configs" / "cpu-smoke.yaml")


def _render(cli, *args: str) -> tuple[int, dict, str, str]:
    status, out, err = cli("render", "-c", SMOKE, "-o", "-", *args)
    return status, (yaml.safe_load(out) if status == 0 else {}), out, err


def _env(doc: dict, service: str = "ps") -> dict:
    return doc["services"][service]["environment"]


def test_the_issues_overrides_reach_the_render_and_its_header(cli):
    status, doc, out, err = _render(cli, "train.lr=0.05", "workers.count=3", "train.optimizer.name=adamw")
    assert status == 0, err
    assert out.splitlines()[2] == "# With the overrides: train.lr=0.05 workers.count=3 train.optimizer.name=adamw"
    assert {"worker1", "worker2", "worker3"} <= set(doc["services"])
    t = load(SMOKE, ["train.lr=0.05", "workers.count=3", "train.optimizer.name=adamw"])
    assert (t.train.lr, t.workers.count, t.train.optimizer) == (0.05, 3, {"name": "adamw"})
    assert t.overrides == ("train.lr=0.05", "workers.count=3", "train.optimizer.name=adamw")
    assert load(SMOKE).overrides == ()
    assert _env(doc)["PSC_LR"] == _env(_render(cli, "train.lr=5e-2")[1])["PSC_LR"]  # 5e-2: as the file reads it


def test_values_are_yaml_and_the_last_of_a_key_wins():
    t = load(SMOKE, ["train.lr=0.2", "train.lr=0.3", "train.overlap=true", "workers.gpus=null", "+train.seed=7"])
    assert (t.train.lr, t.train.overlap, t.train.seed) == (0.3, True, 7)
    t = load(SMOKE, ["train.optimizer={name: adamw, weight_decay: 0.01}", "ps.checkpoint_every=50", "name='007'"])
    assert (t.train.optimizer, t.ps.checkpoint_every) == ({"name": "adamw", "weight_decay": 0.01}, 50)
    assert t.name == "007"  # quoted: a string, as in the file


def test_an_override_completes_a_file_and_a_tilde_removes_a_key(tmp_path):
    partial = topology()
    del partial["train"]["lr"]
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(partial))
    assert load(path, ["train.lr=0.1"]).train.lr == 0.1
    with pytest.raises(TopologyError, match=r"^.*t\.yaml: train\.lr: missing; this key is required$"):
        load(path)
    with pytest.raises(TopologyError) as e:
        load(SMOKE, ["~train.lr"])
    assert str(e.value) == f"{SMOKE} with ~train.lr: train.lr: missing; this key is required"


def test_flags_apply_after_the_overrides():
    t = load_with(SMOKE, workers=4, name="other", overrides=["workers.count=3", "name=mine"])
    assert (t.workers.count, t.name, t.overrides) == (4, "other", ("workers.count=3", "name=mine"))


# (override, the one error line after "error: ")
BAD = [
    ("train.lr=abc", f"{SMOKE} with train.lr=abc: train.lr: got 'abc'; must be a valid number"),
    ("workers.count=0", f"{SMOKE} with workers.count=0: workers.count: got 0; must be greater than 0"),
    (
        "train.optimizer.name=adamx",
        f"{SMOKE} with train.optimizer.name=adamx: train.optimizer.name: got 'adamx'; must be one of sgd, adam,",
    ),
    (
        "train.optimizer={name: adam, betas: [0.9]}",
        f"{SMOKE} with train.optimizer={{name: adam, betas: [0.9]}}: train.optimizer.betas: got [0.9]; must be two",
    ),
    ("train.lr=1e400", f"{SMOKE} with train.lr=1e400: train.lr: got inf; must be a finite number"),
    ("ps.rpc_timeout=.inf", f"{SMOKE} with ps.rpc_timeout=.inf: ps.rpc_timeout: got inf; must be a finite number"),
    ("train.clip_grad_norm=.nan", f"{SMOKE} with train.clip_grad_norm=.nan: train.clip_grad_norm: got nan; must be"),
    ("train.batch_size=[32]", f"{SMOKE} with train.batch_size=[32]: train.batch_size: got [32]; must be a valid"),
    ("train.strategy=fast", f"{SMOKE} with train.strategy=fast: train.strategy: got 'fast'; must be"),
    (
        "train.learning_rate=0.1",
        f"{SMOKE} with train.learning_rate=0.1: train.learning_rate: unknown key; did you mean lr?",
    ),
    ("train.lrate=0.1", f"{SMOKE} with train.lrate=0.1: train.lrate: unknown key; allowed: model, dataset"),
    ("trian.lr=0.1", f"{SMOKE} with trian.lr=0.1: trian: unknown key; did you mean train? allowed: name, image"),
    ("lr", "override 'lr': must be KEY=VALUE with a dotted KEY (train.lr=0.05), or ~KEY to remove one"),
    ("=1", "override '=1': must be KEY=VALUE with a dotted KEY"),
    ("train..lr=1", "override 'train..lr=1': must be KEY=VALUE with a dotted KEY"),
    ("+++train.lr=1", "override '+++train.lr=1': must be KEY=VALUE"),
    ("~train.lr=1", "override '~train.lr=1': must be KEY=VALUE"),
    ("train.lr.x=1", "override 'train.lr.x=1': train.lr: got 0.1; must be a mapping to set train.lr.x in"),
    ("train.lr=[1", "override 'train.lr=[1': train.lr: got '[1'; must be a YAML value (expected ',' or ']',"),
]


@pytest.mark.parametrize("arg, line", BAD, ids=[b[0] for b in BAD])
def test_a_bad_override_is_one_line_exit_2_and_nothing_written(cli, tmp_path, arg, line):
    status, out, err = cli("render", "-c", SMOKE, arg)
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {line}"), err
    assert not list(tmp_path.iterdir())  # no compose.yaml, nothing half-written


def test_the_override_at_fault_is_named_among_several():
    with pytest.raises(TopologyError) as e:
        load(SMOKE, ["train.lr=0.2", "workers.count=-1", "train.seed=3"])
    assert str(e.value) == f"{SMOKE} with workers.count=-1: workers.count: got -1; must be greater than 0"


def test_a_rule_between_keys_broken_by_overrides_names_them_all():
    """A field no override names: the file with all of them, since together they broke it."""
    with pytest.raises(TopologyError) as e:
        load(SMOKE, ["train.seed=1", "train.overlap=true", "train.strategy=sync"])
    assert str(e.value).startswith(f"{SMOKE} with ")
    assert "train.overlap" in str(e.value)


def test_a_missing_required_key_whose_near_namesake_is_given_names_both(tmp_path):
    doc = topology()
    doc["train"]["learning_rate"] = doc["train"].pop("lr")
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(TopologyError) as e:
        load(path)
    assert str(e.value).startswith(
        f"{path}: train.learning_rate: unknown key; train.lr is required and missing: "
        "is learning_rate meant as lr? allowed: model, dataset,"
    )
    doc = topology()
    doc["worker"] = doc.pop("workers")
    with pytest.raises(TopologyError) as e:
        parse(yaml.safe_dump(doc), "t.yaml")
    assert (
        str(e.value) == "t.yaml: workers: missing; this key is required; worker is given: is worker meant as workers?"
    )


def test_near_namesakes():
    known = ["lr", "batch_size", "epochs", "staleness_lr", "seed"]
    assert near("learning_rate", known) == ["lr"]
    assert near("batchsize", known) == ["batch_size"]
    assert near("epoch", known) == ["epochs"]
    assert near("weights", known) == []


def test_the_parser_reads_hydras_forms():
    assert overrides.parse("train.lr=0.05") == overrides.Override("train.lr=0.05", "train.lr", 0.05)
    assert overrides.parse("++train.lr=1").key == "train.lr"
    assert overrides.parse("train.model=").value == ""
    assert overrides.parse("train.model=a=b").value == "a=b"
    assert overrides.parse("~ps").remove
    with pytest.raises(UsageError):
        overrides.parse("train.lr")


@pytest.mark.parametrize(
    "raw, value",
    [
        ("010", 10),  # decimal, never YAML 1.1's octal (8)
        ("08", 8),  # not an error
        ("-007", -7),
        ("1_000", 1000),
        ("1:30", "1:30"),  # not YAML 1.1's sexagesimal (90)
        ("5e-2", 0.05),
        (".5", 0.5),
        ("inf", float("inf")),
        ("TRUE", True),
        ("False", False),
        ("yes", "yes"),  # not YAML 1.1's booleans
        ("on", "on"),
        ("NULL", None),
        ("2026-12-07", "2026-12-07"),  # not a date
        ("0x10", "0x10"),
        ("'010'", "010"),  # quoted: a string
        ("[010, true, off]", [10, True, "off"]),
    ],
)
def test_a_value_is_typed_as_hydra_types_it(raw: str, value) -> None:
    got = overrides.parse(f"train.x={raw}").value
    assert got == value and type(got) is type(value)


def test_a_seed_with_a_leading_zero_is_that_number_and_a_time_is_no_count(cli):
    status, doc, _, err = _render(cli, "train.seed=010")
    assert status == 0, err
    assert _env(doc)["PSC_SEED"] == "10"
    status, _, _, err = _render(cli, "train.epochs=1:30")
    assert status == 2 and "train.epochs: got '1:30'; must be a valid integer" in err


def test_the_header_keeps_an_odd_override_on_one_comment_line(cli):
    from orchestrator.render.compose import overrides_line

    status, doc, out, err = _render(cli, "train.optimizer={name: adamw}", "train.seed=1")
    assert status == 0, err
    assert out.splitlines()[2] == "# With the overrides: 'train.optimizer={name: adamw}' train.seed=1"
    assert overrides_line(("a=x\ny: 1",)) == "# With the overrides: 'a=x\\ny: 1'\n"  # a newline cannot break the YAML
    assert overrides_line(()) == ""


def test_every_target_records_them_in_its_header(cli):
    for target in ("swarm", "kubernetes"):
        status, out, err = cli("render", "-c", SMOKE, "-o", "-", "--target", target, "train.lr=0.05")
        assert status == 0, err
        assert "# With the overrides: train.lr=0.05\n" in out


def test_the_run_record_keeps_them(tmp_path):
    t = load(SMOKE, ["train.lr=0.05"])
    backend = get("compose")
    record.save(backend, Cluster(t.name, tmp_path / "compose.yaml", SMOKE, None, None, t), runs=tmp_path)
    saved = json.loads(record.path(backend, tmp_path).read_text())
    assert saved["overrides"] == ["train.lr=0.05"] and saved["config"] == SMOKE
    last = record.load(backend, runs=tmp_path)
    assert last is not None and last.overrides == ("train.lr=0.05",)  # scale reads the topology with them again


def test_make_passes_args_to_the_verb():
    r = subprocess.run(
        ["make", "-n", "render", "CONFIG=configs/cpu-smoke.yaml", "ARGS=train.lr=0.05 workers.count=3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(x for x in r.stdout.splitlines() if " -m orchestrator render " in x)
    assert line.split()[-2:] == ["train.lr=0.05", "workers.count=3"]


def test_up_and_build_take_them(tmp_path):
    from orchestrator.cli import build_parser

    for verb in ("up", "build", "doctor", "local", "check", "stack-up"):
        args = build_parser().parse_args([verb, "-c", SMOKE, "train.lr=0.05"])
        assert args.overrides == ["train.lr=0.05"], verb
    assert Path(SMOKE).is_file()
