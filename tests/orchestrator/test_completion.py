"""`ps-compose completion bash|zsh`: a script made from the command line's own parsers, which a
real bash sources and then completes the verbs, their flags and a topology file with."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from orch_helpers import REPO, cli  # noqa: F401 - cli is a fixture

COMPLETE = """
source <("$PYTHON" -m orchestrator completion bash)
complete -p ps-compose
words() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _shtab_ps_compose; echo "${COMPREPLY[*]}"; }
words ps-compose sc
words ps-compose up --wor
words ps-compose up -c "configs/$PREFIX"
"""


@pytest.mark.skipif(shutil.which("bash") is None and os.environ.get("CI") != "true", reason="needs bash (CI: fails)")
def test_bash_completes_the_verbs_their_flags_and_a_topology_file() -> None:
    env = {"PYTHON": sys.executable, "PREFIX": "cpu-sm"}
    r = subprocess.run(["bash", "-c", COMPLETE], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    registered, verbs, flags, files = r.stdout.splitlines()
    assert registered == "complete -o bashdefault -F _shtab_ps_compose ps-compose"
    assert sorted(verbs.split()) == ["scale", "schema"]
    assert flags.split() == ["--workers"]
    assert files.split() == ["configs/cpu-smoke.yaml"]


def test_zsh_gets_a_compdef_of_the_same_verbs(cli) -> None:  # noqa: F811
    status, out, err = cli("completion", "zsh")
    assert status == 0 and err == ""
    assert out.startswith("#compdef ps-compose") and "stack-up" in out and "--workers" in out


def test_another_shell_is_one_line_and_exit_2(cli) -> None:  # noqa: F811
    status, out, err = cli("completion", "fish")
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1 and "'bash', 'zsh'" in err
