"""`orchestrator check`: its command line, the compose document and process plan it runs, the verdict."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from app.contract import CHECK_RECORD
from orchestrator.cli import build_parser, main
from orchestrator.render import compose as render_compose
from orchestrator.topology.model import load
from orchestrator.topology.services import LABEL_RANK, LABEL_ROLE, rendezvous_service, service_names
from orchestrator.verbs import check as check_verb
from orchestrator.verbs.check import Result, check_document, judge, plan_local, result_record

from orch_helpers import HERE, REPO, topology

SMOKE = REPO / "configs/cpu-smoke.yaml"


def test_cli_parses_check() -> None:
    a = build_parser().parse_args(
        [
            "check",
            "-c",
            "configs/x.yaml",
            "--workers",
            "3",
            "--local",
            "--timeout",
            "5",
            "--without",
            "worker2",
            "--without",
            "ps",
        ]
    )
    assert (a.config, a.workers, a.local, a.timeout, a.without) == ("configs/x.yaml", 3, True, 5, ["worker2", "ps"])
    a = build_parser().parse_args(["check"])
    assert (a.config, a.workers, a.local, a.timeout, a.without, a.build) == (
        "configs/default.yaml",
        None,
        False,
        30,
        None,
        False,
    )


@pytest.mark.parametrize("argv", [["check", "--timeout", "0"], ["check", "--workers", "x"], ["check", "--bogus"]])
def test_cli_bad_check_flags_exit_2(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: python -m orchestrator")


def test_without_an_unknown_service_is_bad_input(capsys) -> None:
    assert main(["check", "-c", str(SMOKE), "--without", "worker9", "--local"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --without worker9: not a service of this topology (ps, worker1, worker2)"


def test_check_document_runs_check_per_rank_and_nothing_that_waits() -> None:
    t = load(SMOKE).with_workers(3)
    doc = check_document(t, timeout=7)
    train = render_compose.render(t)
    assert list(doc["services"]) == ["ps", "worker1", "worker2", "worker3"]
    assert doc["networks"] == train["networks"] and "volumes" not in doc
    for rank, (name, svc) in enumerate(doc["services"].items()):
        assert svc["command"] == ["check", "--rank", str(rank)]
        assert svc["image"] == t.image_tag and svc["networks"] == [render_compose.NETWORK]
        assert svc["user"] == render_compose.APP_USER and svc["cap_drop"] == ["ALL"]
        for key in ("healthcheck", "depends_on", "restart", "volumes", "build", "deploy", "ports"):
            assert key not in svc, (name, key)
        env = svc["environment"]
        assert (
            env["PSC_RANK"],
            env["PSC_WORLD_SIZE"],
            env["PSC_MASTER_ADDR"],
            env["PSC_MASTER_PORT"],
            env["PSC_RPC_TIMEOUT"],
            env["PSC_STRATEGY"],
        ) == (str(rank), "4", "ps", str(t.ps.rpc_port), "7", "async")
        assert env["GLOO_SOCKET_IFNAME"] == train["services"][name]["environment"]["GLOO_SOCKET_IFNAME"]
        assert svc["labels"][LABEL_ROLE] == "check" and svc["labels"][LABEL_RANK] == str(rank)


def test_check_document_of_a_gpu_topology_reserves_no_gpu() -> None:
    doc = check_document(load(REPO / "configs/default.yaml").with_workers(2))
    assert all("deploy" not in svc for svc in doc["services"].values())


def test_without_leaves_the_service_out_but_keeps_the_world_size() -> None:
    doc = check_document(load(SMOKE), without=["worker2"])
    assert list(doc["services"]) == ["ps", "worker1"]
    assert doc["services"]["worker1"]["environment"]["PSC_WORLD_SIZE"] == "3"


def test_check_document_is_valid_compose() -> None:
    schema = json.loads((HERE / "compose-spec.json").read_text())
    doc = yaml.safe_load(render_compose.dump(check_document(load(SMOKE).with_workers(2)), "cpu-smoke"))
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(doc)
    ]
    assert errors == []


def test_check_runs_as_its_own_project() -> None:
    assert check_verb.project_name(load(SMOKE)) == "cpu-smoke-check"


def test_rank_0_is_the_first_service(write_config) -> None:
    # allreduce has no PS: rank 0 is whatever service comes first (worker1 there).
    for strategy in ("async", "sync", "allreduce"):
        t = load(write_config(topology(train={"strategy": strategy})))
        names = service_names(t)
        doc = check_document(t)
        assert list(doc["services"]) == names
        assert {s["environment"]["PSC_MASTER_ADDR"] for s in doc["services"].values()} == {names[0]}
        assert {s["environment"]["PSC_STRATEGY"] for s in doc["services"].values()} == {strategy}
        assert names[0] == rendezvous_service(t)
        plan = plan_local(t, port=1, python="/py")
        assert [(p.name, p.env["PSC_RANK"]) for p in plan] == [(n, str(k)) for k, n in enumerate(names)]


def test_local_plan(tmp_path: Path) -> None:
    t = load(SMOKE)
    plan = plan_local(t, port=4321, timeout=9, without=["worker1"], run_dir=tmp_path, ifname="lo", python="/py")
    assert [(p.name, p.rank, p.argv) for p in plan] == [
        ("ps", 0, ["/py", "-m", "app", "check", "--rank", "0"]),
        ("worker2", 2, ["/py", "-m", "app", "check", "--rank", "2"]),
    ]
    for p in plan:
        assert (
            p.env["PSC_RANK"],
            p.env["PSC_WORLD_SIZE"],
            p.env["PSC_MASTER_ADDR"],
            p.env["PSC_MASTER_PORT"],
            p.env["PSC_RPC_TIMEOUT"],
            p.env["GLOO_SOCKET_IFNAME"],
        ) == (str(p.rank), "3", "127.0.0.1", "4321", "9", "lo")


# --- the verdict --------------------------------------------------------------

NAMES = ["ps", "worker1", "worker2"]
REPORT = [
    "check: ps (rank 0) on h 10.0.0.2 waits for 2 ranks at ps:29500 (at most 30 s)",
    "check: all 3 ranks registered in 0.20 s",
    "check: worker1  rank 1  host a 10.0.0.3: 4 B 0.20 ms, 8 MiB 9.00 ms, 1.86 GB/s",
    "check: worker2  rank 2  host b 10.0.0.4: 4 B 0.20 ms, 8 MiB 9.00 ms, 1.86 GB/s",
    "check passed: 3 ranks, every tensor came back unchanged (0.5 s)",
]
MISSING = "worker2 (rank 2) did not reach ps:29500 within 5 s (2 of 3 ranks registered)"


def output(rank: int, name: str, *, failed: str | None = None, report: list[str] | None = None, **kw) -> str:
    """What a rank prints: its lines for people, then its result record (app/contract.py
    CHECK_RECORD), as app/connectivity.py writes it."""
    record = {
        "rank": rank,
        "name": name,
        "passed": failed is None,
        "failed": failed,
        "blame": [],
        "unreachable": False,
        "called_off": False,
        "report": report or [],
        **kw,
    }
    people = "\n".join(report or []) + ("\ncheck failed: " + failed if failed else "")
    return people + "\n" + CHECK_RECORD + json.dumps(record) + "\n"


PASSED = output(0, "ps", report=REPORT)
OK_RANK = output(1, "worker1")


def test_judge_passed() -> None:
    v = judge(
        NAMES,
        [Result("ps", 0, 0, PASSED), Result("worker1", 1, 0, OK_RANK), Result("worker2", 2, 0, output(2, "worker2"))],
    )
    assert v.passed and v.failing == []
    assert v.lines == REPORT


def test_the_result_record_is_read_and_a_missing_one_is_none() -> None:
    assert result_record(PASSED)["report"] == REPORT
    assert result_record("check: some line for people\n") is None
    assert result_record(CHECK_RECORD + "{broken\n") is None


def test_judge_missing_rank_names_it_once() -> None:
    rank0 = output(0, "ps", report=REPORT[:1], failed=MISSING, blame=["worker2"])
    told = output(
        1, "worker1", failed="worker1 (rank 1): ps (rank 0) called the check off: " + MISSING, called_off=True
    )
    v = judge(NAMES, [Result("ps", 0, 1, rank0), Result("worker1", 1, 1, told)], without=["worker2"])
    assert not v.passed and v.failing == ["worker2"]
    assert v.lines[-2:] == [
        "check failed: " + MISSING,
        "check failed: worker2 (rank 2) was not started (--without worker2)",
    ]
    assert not any("called the check off" in ln for ln in v.lines)


def test_judge_missing_rank_0_blames_it() -> None:
    cannot = "worker{k} (rank {k}) could not reach ps (rank 0) at ps:29500 within 5 s: cannot resolve ps"
    v = judge(
        NAMES,
        [
            Result(f"worker{k}", k, 1, output(k, f"worker{k}", failed=cannot.format(k=k), unreachable=True))
            for k in (1, 2)
        ],
        without=["ps"],
    )
    assert v.failing == ["ps"] and not v.passed
    assert v.lines[0] == "check failed: ps (rank 0) was not started (--without ps)"


def test_judge_a_rank_that_cannot_reach_a_working_rank_0_is_to_blame() -> None:
    rank0 = output(0, "ps", report=REPORT[:1], failed=MISSING, blame=["worker2"])
    cannot = "worker2 (rank 2) could not reach ps (rank 0) at ps:29500 within 5 s: timed out"
    v = judge(
        NAMES,
        [
            Result("ps", 0, 1, rank0),
            Result("worker1", 1, 1, ""),
            Result("worker2", 2, 1, output(2, "worker2", failed=cannot, unreachable=True)),
        ],
    )
    assert v.failing == ["worker1", "worker2"]  # worker1 exited 1 with no result: a crash


def test_judge_hung_and_crashed_ranks() -> None:
    v = judge(
        NAMES,
        [
            Result("ps", 0, None, REPORT[0]),
            Result("worker1", 1, 0, OK_RANK),
            Result("worker2", 2, 2, "app: error: argument role: invalid choice: 'check'"),
        ],
    )
    assert not v.passed and v.failing == ["ps", "worker2"]
    assert "check failed: ps (rank 0) did not exit in time" in v.lines
    assert "check failed: worker2 (rank 2) exited 2: app: error: argument role: invalid choice: 'check'" in v.lines


def test_judge_rank_0_silent_is_a_failure() -> None:
    v = judge(NAMES, [Result("ps", 0, 0, ""), Result("worker1", 1, 0, OK_RANK), Result("worker2", 2, 0, OK_RANK)])
    assert not v.passed and v.failing == ["ps"]


def test_check_names_ps_shards_as_the_app_does() -> None:
    from app.connectivity import rank_names as app_rank_names

    base = load(SMOKE)
    t = base.model_copy(update={"ps": dataclasses.replace(base.ps, shards=2)})
    doc = check_document(t, timeout=7)
    assert list(doc["services"]) == ["ps", "ps-shard1", "worker1", "worker2"]
    env = doc["services"]["ps-shard1"]["environment"]
    names = app_rank_names(int(env["PSC_WORLD_SIZE"]), env["PSC_STRATEGY"], int(env["PSC_SHARDS"]))
    assert names == list(doc["services"])
