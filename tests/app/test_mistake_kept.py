"""A mistake said once: a process that exits 2 on a mistake keeps its line where PSC_STOP_FILE
says, and a restart of it (compose's `restart: on-failure`) says it again and exits 0 instead of
failing in a loop; without the variable (`local`) every start fails alike."""

from __future__ import annotations

from app.contract import STOP_FILE_ENV

from app_testkit import app_env, run_app

BAD = ("ps", "--optimizer", '{"name": "adam", "betas": [0.9]}')
LINE = "app: error: --optimizer: betas: got [0.9]; must be two numbers in [0, 1), as [0.9, 0.999]"


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("app: error:")]


def test_a_restart_after_a_mistake_says_it_again_and_exits_0(tmp_path):
    env = app_env(**{STOP_FILE_ENV: str(tmp_path / "stopped")})
    first = run_app(*BAD, env=env)
    assert first.returncode == 2 and _errors(first.stderr) == [LINE]
    again = run_app(*BAD, env=env)
    assert again.returncode == 0
    assert _errors(again.stderr) == [
        f"{LINE} (not retried: this container stopped on it at its first start; fix it and start the run again)"
    ]
    assert run_app("health", "--socket_dir", str(tmp_path), env=env).returncode == 1  # health still probes


def test_without_a_stop_file_every_start_fails_alike(tmp_path):
    for _ in range(2):
        r = run_app(*BAD)
        assert r.returncode == 2 and _errors(r.stderr) == [LINE]
    assert not list(tmp_path.iterdir())
