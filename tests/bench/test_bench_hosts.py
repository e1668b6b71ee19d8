"""`python -m bench hosts`: its refusals, each case's processes and environment, and its rows
read from real metrics records. (A run takes minutes over its shaped link: it is a benchmark,
run by hand, not here.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import hosts, wire
from bench.__main__ import main


def test_refuses_in_one_line_with_status_2_when_not_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["hosts"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs root" in err


@pytest.mark.parametrize(("flags", "said"), [(["--cases", "async,hogwild"], "'hogwild'"), (["--rate", "9G"], "--rate")])
def test_refuses_an_unknown_case_or_rate_naming_it(monkeypatch, capsys, flags, said):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(wire, "tools", lambda: {"ip": "/sbin/ip", "tc": "/sbin/tc", "nsenter": "/usr/bin/nsenter"})
    monkeypatch.setattr(hosts, "tools", wire.tools)
    assert main(["hosts", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err


@pytest.mark.parametrize("case", list(hosts.CASES))
def test_each_case_runs_the_lm_over_tcp_between_the_namespaces(case, tmp_path):
    """The job's TCP transport at the server side's address (never the shared memory, which the two
    namespaces would share), the case's strategy and local steps, and a dozen evaluations; the
    PS (allreduce: worker1, DDP's rank 0 and its store) on the server's side."""
    strategy, local_steps, _ = hosts.CASES[case]
    procs = hosts.environments(case, 240, tmp_path / case, "pscwc")
    names = [name for name, *_ in procs]
    assert names == (["worker1", "worker2"] if strategy == "allreduce" else ["ps", "worker1", "worker2"])
    for name, side, argv, env in procs:
        assert side == ("s" if name == names[0] else "c")
        assert argv[-1] == ("ps" if name == "ps" else "worker")
        assert env["PSC_MASTER_ADDR"] == wire.ADDRESSES["s"] and env["PSC_EXCHANGE"] == "transport"
        assert "PSC_SHM_DIR" not in env and not any(k.startswith("PSC_SOCKET") for k in env)
        assert (env["PSC_STRATEGY"], env["PSC_MAX_STEPS"]) == (strategy, "240")
        assert env.get("PSC_LOCAL_STEPS", "16") == str(local_steps)  # 16: the default, not written
        assert Path(env["PSC_SECRET_FILE"]).stat().st_mode & 0o777 == 0o600
        updates = -(-(480 if strategy in ("async", "diloco_async") else 240) // local_steps)
        assert int(env["PSC_EVAL_EVERY"]) == max(1, updates // hosts.EVALS)  # about a dozen, or each update


def _records(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_row_times_each_evaluation_from_the_last_join_and_finds_the_target(tmp_path):
    _records(
        tmp_path / "metrics" / "ps.jsonl",
        [
            {"time": 100.0, "event": "start"},
            {"time": 100.5, "event": "join"},
            {"time": 101.0, "event": "join"},
            {"time": 111.0, "event": "eval", "perplexity": 12.0},
            {"time": 121.0, "event": "eval", "perplexity": 9.2},
            {"time": 131.0, "event": "eval", "perplexity": 8.9},
            {"time": 132.0, "event": "end", "perplexity": 8.9},
        ],
    )
    r = hosts.row("diloco-h16", tmp_path / "metrics", 12_345_678)
    assert r == {
        "case": "diloco-h16",
        "perplexity": 8.9,
        "wall_s": 31.0,
        "evals": [(10.0, 12.0), (20.0, 9.2), (30.0, 8.9), (31.0, 8.9)],
        "mbytes": 12.3,
    }
    assert hosts.time_to(r, 9.5) == 20.0 and hosts.time_to(r, 8.0) is None
    table = hosts.table([r], 9.5)
    assert "to 9.50 s" in table and "diloco-h16" in table and "20.0" in table
    assert "never" in hosts.table([r], 8.0)


def test_allreduce_is_read_from_worker1_its_evaluator(tmp_path):
    _records(
        tmp_path / "metrics" / "worker1.jsonl",
        [{"time": 5.0, "event": "start"}, {"time": 9.0, "event": "end", "perplexity": 10.5}],
    )
    assert hosts.row("allreduce", tmp_path / "metrics", 0)["wall_s"] == 4.0


def test_a_case_without_a_held_out_perplexity_fails_naming_the_file(tmp_path):
    _records(tmp_path / "metrics" / "ps.jsonl", [{"time": 1.0, "event": "start"}])
    with pytest.raises(RuntimeError, match="ps.jsonl holds no held-out perplexity"):
        hosts.row("async", tmp_path / "metrics", 0)
