"""A bench case whose port another process took before its PS bound it (EADDRINUSE, seen
under CI's load) runs again on a new port, once; any other failure is the case's result."""

from __future__ import annotations

import pytest

from bench import procs

CASE = procs.Case("ref-uv", "cnn", 2)
TAKEN = "ps exited 1: DistNetworkError: ... port: 39035, code: -98, name: EADDRINUSE, message: address already in use"


def _failing(errors: list[str]):
    calls: list[int] = []

    def once(case, params, timeout, idle_seconds):
        calls.append(1)
        if errors:
            raise procs.CaseFailed(errors.pop(0))
        return {"workers": [], "ps": {}, "idle_cpu_percent": None}

    return once, calls


def test_a_case_whose_port_was_taken_runs_again_on_another(monkeypatch, capsys):
    once, calls = _failing([TAKEN])
    monkeypatch.setattr(procs, "_run_case_once", once)
    assert procs.run_case(CASE, {}, 10.0) == {"workers": [], "ps": {}, "idle_cpu_percent": None}
    assert len(calls) == 2
    assert "bench: ref-uv: its port was taken before the PS bound it; again on another" in capsys.readouterr().err


def test_a_port_taken_twice_fails_the_case_with_the_error(monkeypatch):
    once, calls = _failing([TAKEN, TAKEN])
    monkeypatch.setattr(procs, "_run_case_once", once)
    with pytest.raises(procs.CaseFailed, match="EADDRINUSE"):
        procs.run_case(CASE, {}, 10.0)
    assert len(calls) == procs.PORT_TRIES


def test_any_other_failure_is_not_run_again(monkeypatch):
    once, calls = _failing(["worker1 exited 1: RuntimeError: boom"])
    monkeypatch.setattr(procs, "_run_case_once", once)
    with pytest.raises(procs.CaseFailed, match="boom"):
        procs.run_case(CASE, {}, 10.0)
    assert len(calls) == 1
