"""`python -m app` as a subprocess: bad input exits 2 with one line on stderr, before any RPC."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from app_testkit import app_env, free_port, run_app
from needs import unavailable

pytestmark = pytest.mark.slow  # each test starts `python -m app` (no RPC, a second or two)


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("app: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["ps", "--batch_size", "x"], "--batch_size: 'x' is not a valid int"),
        (["worker", "--no_such_flag"], "unrecognized arguments: --no_such_flag"),
        (["ps", "--model", "no_such_net", "--dataset", "digits"], "unknown model 'no_such_net'"),
        (["ps", "--model", "cnn", "--dataset", "no_such_set"], "--dataset: 'no_such_set' is not one of"),
        (
            ["worker", "--model", "cnn", "--dataset", "imagefolder", "--data_dir", "/no/such/dir"],
            "data dir not found: /no/such/dir",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(args, expected):
    result = run_app(*args, "--master_port", str(free_port()))
    assert result.returncode == 2
    assert expected in _one_error_line(result)
    assert result.stdout == ""


def test_empty_data_dir_exits_2_naming_it(tmp_path):
    result = run_app("ps", "--model", "cnn", "--dataset", "mnist", "--data_dir", str(tmp_path))
    assert result.returncode == 2
    assert _one_error_line(result) == f"app: error: data dir is empty: {tmp_path}"


def test_bad_env_value_exits_2():
    result = run_app("worker", env=app_env(PSC_LR="fast"))
    assert result.returncode == 2
    assert "PSC_LR: 'fast' is not a valid float" in _one_error_line(result)


@pytest.mark.parametrize(
    ("role", "env", "expected"),
    [
        # what the topology refuses (workers.max below workers.count), the app refuses too
        ("ps", {"PSC_WORLD_SIZE": "3", "PSC_MAX_WORKERS": "1"}, "PSC_MAX_WORKERS: got 1; must be at least the number"),
        ("worker", {"PSC_WORLD_SIZE": "4", "PSC_MAX_WORKERS": "0"}, "PSC_MAX_WORKERS: got 0; must be at least the"),
        ("ps", {"PSC_RANK": "7"}, "PSC_RANK: got 7; the ps role is rank 0 (leave it out, or 0)"),
    ],
)
def test_what_the_topology_refuses_the_app_refuses_in_one_line(role, env, expected):
    result = run_app(
        role, "--model", "cnn", "--dataset", "digits", env=app_env(PSC_MASTER_PORT=str(free_port()), **env)
    )
    assert result.returncode == 2
    assert expected in _one_error_line(result)
    assert result.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_cuda_without_gpu_exits_2():
    result = run_app("worker", "--device", "cuda", "--model", "cnn", "--dataset", "digits")
    assert result.returncode == 2
    assert "--device cuda: no CUDA GPU is visible" in _one_error_line(result)


def _without_torchvision(tmp_path, body: str) -> dict[str, str]:
    """The app's environment with a `torchvision` package in front whose import runs `body`."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(body)
    env = app_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    return env


def test_torchvision_model_with_a_mismatched_torchvision_says_so(tmp_path):
    # What PyPI's torchvision does beside a torch it was not built for.
    env = _without_torchvision(tmp_path, 'raise RuntimeError("operator torchvision::nms does not exist")\n')
    result = run_app("ps", "--model", "resnet18", "--dataset", "digits", env=env)
    assert result.returncode == 2
    line = _one_error_line(result)
    assert "torchvision does not import beside torch" in line, line
    assert "RuntimeError: operator torchvision::nms does not exist" in line and "images/torch-pair.txt" in line
    assert line.endswith(": cnn, char_transformer"), line


def test_torchvision_model_without_torchvision_names_what_exists(tmp_path):
    env = _without_torchvision(
        tmp_path, 'raise ModuleNotFoundError("No module named \'torchvision\'", name="torchvision")\n'
    )
    result = run_app("ps", "--model", "resnet18", "--dataset", "digits", env=env)
    assert result.returncode == 2
    line = _one_error_line(result)
    assert "torchvision is not installed" in line and line.endswith(": cnn, char_transformer"), line


def test_health_is_0_when_the_port_listens_and_1_when_not():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert run_app("health", "--master_port", str(port)).returncode == 0
    assert run_app("health", env=app_env(PSC_MASTER_PORT=str(free_port()))).returncode == 1


def test_a_freed_big_tensor_stays_mapped_for_the_next_message_under_glibc():
    # What keep_freed_memory is for: every received message is a fresh 47 MB tensor.
    # By default glibc gives each one its own mmap and unmaps it when freed; tuned,
    # the memory stays in the heap for the next one (no munmap, no fresh mapping).
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        unavailable("mallopt tuning is glibc-only")
    code = (
        "import sys, torch; from app.runtime import machine;"
        "sys.argv[1] == 'tuned' and machine.keep_freed_memory();"
        "t = torch.empty(12_000_000); t.fill_(1.0); p = t.data_ptr(); del t;"
        "spans = [[int(x, 16) for x in line.split()[0].split('-')] for line in open('/proc/self/maps')];"
        "print(int(any(lo <= p < hi for lo, hi in spans)))"
    )
    mapped = {}
    for mode in ("tuned", "default"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        mapped[mode] = out.stdout.strip() == "1"
    assert mapped == {"tuned": True, "default": False}


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv,env,message",
    [
        (["ps", "--lr", "nan"], {}, "app: error: --lr: nan is not a finite number"),
        (["worker"], {"PSC_RPC_TIMEOUT": "inf"}, "app: error: PSC_RPC_TIMEOUT: inf is not a finite number"),
        (["ps"], {"OMP_NUM_THREADS": "4,2"}, "app: error: OMP_NUM_THREADS: '4,2' is not a positive integer"),
        (["worker"], {"OMP_NUM_THREADS": "0"}, "app: error: OMP_NUM_THREADS: '0' is not a positive integer"),
    ],
)
def test_non_finite_flags_and_bad_omp_num_threads_exit_2_with_one_line(argv, env, message):
    result = run_app(*argv, env=app_env(**env), timeout=30)
    assert result.returncode == 2 and result.stderr.strip().startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
