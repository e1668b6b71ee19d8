"""Flags, PSC_* environment and defaults: flag > env > default; bad input names the source."""

from __future__ import annotations

import re

import pytest

from app.config import Config, UsageError, check_threads_env, parse


def test_defaults_are_the_seeds():
    config = parse(["worker"], {})
    assert (config.model, config.dataset, config.data_dir) == ("resnet18", "imagefolder", "./imagenette2/val")
    assert (config.rank, config.world_size, config.batch_size, config.lr, config.epochs) == (1, 3, 256, 0.01, 150)
    assert (config.master_addr, config.master_port) == ("localhost", 6100)


def test_env_overrides_default_and_flag_overrides_env():
    env = {"PSC_BATCH_SIZE": "64", "PSC_LR": "0.5", "PSC_MODEL": "cnn", "PSC_DATA_DIR": "/data"}
    config = parse(["worker", "--lr", "0.25"], env)
    assert config.batch_size == 64  # env over default
    assert config.lr == 0.25  # flag over env
    assert config.model == "cnn" and config.data_dir == "/data"


def test_empty_env_value_means_unset():
    assert parse(["ps"], {"PSC_LR": ""}).lr == Config.lr


def test_other_env_vars_are_ignored():
    assert parse(["ps"], {"LR": "9", "PSC_UNKNOWN": "1"}).lr == 0.01


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["ps", "--lr", "abc"], {}, "--lr: 'abc' is not a valid float"),
        (["ps"], {"PSC_BATCH_SIZE": "many"}, "PSC_BATCH_SIZE: 'many' is not a valid int"),
        (["ps"], {"PSC_DEVICE": "gpu"}, "PSC_DEVICE: 'gpu' is not one of cpu, cuda"),
        (["ps", "--dataset", "imagenet"], {}, "--dataset: 'imagenet' is not one of"),
        (["ps", "--bogus", "1"], {}, "unrecognized arguments: --bogus 1"),
        (["ps", "--batch"], {}, "unrecognized arguments: --batch"),
        (["trainer"], {}, "invalid choice: 'trainer'"),
        (["ps", "--world_size", "1"], {}, "--world_size: 1 must be >= 2"),
        (["ps", "--lr", "0"], {}, "--lr: 0.0 must be > 0"),
        (["ps", "--momentum", "1"], {}, "--momentum: 1.0 must be < 1"),
        (["ps", "--master_port", "70000"], {}, "--master_port: 70000 must be <= 65535"),
        (["worker", "--rank", "3", "--world_size", "3"], {}, "--rank: 3 must be in 1..2"),
        (["worker", "--rank", "0"], {}, "--rank: 0 must be in 1..2"),
        # the rules between options (app/option_rules.py RULES), as the topology names them
        (["ps"], {"PSC_MAX_WORKERS": "1"}, "PSC_MAX_WORKERS: got 1; must be at least the number of workers (2), or"),
        (["ps", "--world_size", "4", "--max_workers", "0"], {}, "--max_workers: got 0; must be at least the number"),
        (
            ["ps", "--strategy", "sync", "--overlap", "true"],
            {},
            "--overlap: got true; allowed only with strategy async",
        ),
        # handed to the workers as it is: a relative one was accepted and meant another directory to each
        (["ps"], {"PSC_SHM_DIR": "shm"}, "PSC_SHM_DIR: 'shm' is not an absolute path; give the tmpfs directory"),
        (["worker", "--shm_dir", "./x"], {}, "--shm_dir: './x' is not an absolute path"),
    ],
)
def test_bad_input_raises_usage_error_naming_it(argv, env, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        parse(argv, env)


def test_ps_is_rank_0_and_names_itself_ps():
    config = parse(["ps", "--world_size", "5"], {"PSC_RANK": "0"})
    assert (config.name, config.num_trainers) == ("ps", 4)
    assert parse(["ps", "--world_size", "5"], {}).name == "ps"
    with pytest.raises(UsageError, match=r"^PSC_RANK: got 9; the ps role is rank 0 \(leave it out, or 0\)$"):
        parse(["ps", "--world_size", "5"], {"PSC_RANK": "9"})
    assert parse(["worker", "--rank", "2"], {}).name == "worker2"


def test_a_process_started_by_hand_keeps_its_state_where_git_does_not_look():
    """`python -m app ps` from the repository root: its checkpoints, metrics and cache go under
    runs/app/ (ignored), never into folders of the tree (before: ./checkpoints, ./metrics)."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    config = parse(["ps"], {})
    for d in (config.checkpoint_dir, config.metrics_dir, config.cache_dir):
        assert d.startswith("./runs/app/"), d
        probe = f"{d}/x.jsonl"
        assert subprocess.run(["git", "check-ignore", "-q", probe], cwd=repo).returncode == 0, d


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--lr", "nan"),
        ("--momentum", "nan"),
        ("--rpc_timeout", "inf"),
        ("--rpc_timeout", "nan"),
        ("--join_timeout", "nan"),
        ("--join_timeout", "inf"),
        ("--lr", "-inf"),
    ],
)
def test_non_finite_float_flags_are_refused_naming_the_flag(flag, value):
    with pytest.raises(UsageError, match=f"^{flag}: {value} is not a finite number"):
        parse(["ps", f"{flag}={value}"], {})


@pytest.mark.parametrize("value", ["4,2", "0", "abc", "-1"])
def test_a_bad_omp_num_threads_is_refused(value):
    with pytest.raises(UsageError, match=f"OMP_NUM_THREADS: '{value}' is not a positive integer"):
        check_threads_env({"OMP_NUM_THREADS": value})
    check_threads_env({"OMP_NUM_THREADS": "3"})
    check_threads_env({})
