"""The bench's drive of the app's PS and worker (bench/appdrive.py): the case's processes share a
secret and a directory of UNIX sockets made for the case, as `make local` gives a run, and a
sharded PS's processes each serve their slice and end once the workers have left."""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from app.config import parse
from app.exchange import secret
from bench import procs
from bench.__main__ import _state_floats, full_params


def test_a_cases_secret_and_socket_directory_are_closed_to_everyone_else_and_given_as_flags(tmp_path):
    files = procs.job_files(tmp_path)
    assert stat.S_IMODE(os.stat(files["secret_file"]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(files["socket_dir"]).st_mode) == 0o700
    assert len(secret.read(files["secret_file"])) >= 2 * secret.MIN_SECRET_BYTES
    config = parse(["worker", "--rank", "1", *procs.app_flags(files)], {})
    assert (config.secret_file, config.socket_dir) == (files["secret_file"], files["socket_dir"])


@pytest.mark.slow
@pytest.mark.parametrize("system", ["app-sharded", "app-comm-bf16"])
def test_a_full_matrix_case_of_the_app_runs_its_window_and_every_process_ends(system):
    """app-sharded: two PS processes, each worker's route over one to each; app-comm-bf16: no compute,
    bf16 pushes. Every process ends by itself (the case's timeout would fail it)."""
    params = full_params(argparse.Namespace(warmup=2, seconds=1.0), system, _state_floats("cnn"))
    result = procs.run_case(procs.Case(system, "cnn", 2), params, timeout=240)
    assert [w["steps"] >= 1 for w in result["workers"]] == [True, True]
    assert result["ps"]["version"] >= sum(w["steps"] for w in result["workers"])
    assert result["ps"]["state_floats"] == _state_floats("cnn")
