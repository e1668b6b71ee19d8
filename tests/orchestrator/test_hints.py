"""The commands a line suggests next, in the words of the tool the user typed: make's under
make, the `ps-compose` command's (flags for make's variables) without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.hints import command

from orch_helpers import REPO, cli  # noqa: F401 - cli is a fixture

SMOKE = str(REPO / "configs" / "cpu-smoke.yaml")


def test_under_make_a_hint_is_makes_target_and_variables() -> None:
    assert command("up", NAME="x-2") == "make up NAME=x-2"
    assert command("up", WORKERS="N", RESUME=1) == "make up WORKERS=N RESUME=1"


@pytest.mark.parametrize(
    "verb, variables, words",
    [
        ("logs", {}, "ps-compose logs"),
        ("stack-down", {"NAME": "x"}, "ps-compose stack-down --name x"),
        ("up", {"WORKERS": "N", "RESUME": 1}, "ps-compose up --workers N --resume"),
        ("up", {"RESUME": "20261207-010203-abcdef"}, "ps-compose up --resume=20261207-010203-abcdef"),
        (
            "up",
            {"CONFIG": "configs/cpu-smoke.yaml", "WORKERS": 3},
            "ps-compose up -c configs/cpu-smoke.yaml --workers 3",
        ),
        ("export", {"LOCAL": 1}, "ps-compose export --local"),
        ("soak", {"NAME": "s"}, "ps-compose chaos soak --name s"),
    ],
)
def test_without_make_a_hint_is_the_commands_verb_and_flags(monkeypatch, verb, variables, words) -> None:
    monkeypatch.delenv("PSC_VIA_MAKE")
    assert command(verb, **variables) == words


def test_a_refusal_of_the_pip_installed_command_names_its_own_verbs(cli, monkeypatch, tmp_path) -> None:  # noqa: F811
    """`ps-compose scale` of an allreduce run: the fix it names is the command's, not make's."""
    monkeypatch.delenv("PSC_VIA_MAKE")
    config = tmp_path / "allreduce.yaml"
    config.write_text(Path(SMOKE).read_text().replace("strategy: async", "strategy: allreduce"))
    status, out, err = cli("scale", "-c", str(config), "--workers", "3")
    assert status == 2, (out, err)
    assert "stop it (ps-compose down) and start it again" in err and "ps-compose up --workers N --resume" in err
    assert "make" not in err
