"""An app process forked from tests/app/forkserver.py's server is the `python -m app` an exec
gives: the same output and exit status, the test process's own child, its signals delivered."""

from __future__ import annotations

import os
import signal

import forkserver
import pytest

from app.runtime import machine

from app_testkit import DIGITS, REPO, app_env, finished, free_port, run_app, start_app

pytestmark = pytest.mark.slow  # each test starts `python -m app`


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--batch_size", "x"],  # bad input: one line, exit 2, before torch loads
        ["ps", "--model", "no_such_net", "--dataset", "digits"],  # bad input found with torch loaded
        ["health", "--master_port", "1"],  # nothing listens: exit 1, no output
    ],
)
def test_a_forked_app_says_and_exits_what_an_execd_one_does(argv):
    forked, execd = run_app(*argv, fork=True), run_app(*argv, fork=False)
    assert (forked.returncode, forked.stdout, forked.stderr) == (execd.returncode, execd.stdout, execd.stderr)


def test_a_forked_app_is_the_test_process_child_in_its_directory_and_a_sigterm_ends_it(tmp_path):
    argv = ["ps", *DIGITS, "--world_size", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    argv += ["--metrics_dir", str(tmp_path / "metrics"), "--checkpoint_dir", str(tmp_path / "checkpoints")]
    proc = start_app(tmp_path, "ps", argv)
    assert isinstance(proc, forkserver.ForkedApp)
    with open(f"/proc/{proc.pid}/stat") as stat:
        assert int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid()  # its parent: this process
    assert os.readlink(f"/proc/{proc.pid}/cwd") == str(REPO)
    machine.wait_for_port("127.0.0.1", int(argv[argv.index("--master_port") + 1]), timeout=60)
    assert proc.poll() is None  # the PS waits for its worker
    proc.send_signal(signal.SIGTERM)  # its handler in place: SystemExit(128 + 15) once it comes
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, finished(tmp_path, "ps", proc).stderr
    assert proc.poll() == 128 + signal.SIGTERM


def test_a_pythonpath_with_its_own_torchvision_is_execd(tmp_path):
    (tmp_path / "torchvision").mkdir()
    assert not forkserver.can_fork(dict(app_env(), PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"))
    assert forkserver.can_fork(dict(app_env(), PYTHONPATH=f"{tmp_path / 'mymods'}{os.pathsep}{REPO}"))
