"""Helpers for the app's tests: free ports, `python -m app` runs, PS + worker processes."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import forkserver
import numpy
import pytest

REPO = Path(__file__).resolve().parents[2]

# The CPU job of the cluster tests: the built-in CNN on digits, chosen so that a run takes
# seconds on 2 cores (10 epochs of ~700 samples per worker) and reaches >= 0.90.
DIGITS_JOB = {"model": "cnn", "dataset": "digits", "batch_size": 32}


def digits(**flags: object) -> list[str]:
    """`python -m app` flags of the digits job with `flags` (`--name value`, a later value
    replacing the job's own): each test file's variant of the one job, not a copy of it."""
    return [item for name, value in {**DIGITS_JOB, **flags}.items() for item in (f"--{name}", str(value))]


DIGITS = digits(lr=0.1, num_epochs=10, eval_every=100, rpc_timeout=30, seed=1)


def app_config(role: str = "worker", **flags: object):
    """The app's Config for `python -m app ROLE --name value ...` (no environment)."""
    from app.config import parse

    return parse([role, *(item for name, value in flags.items() for item in (f"--{name}", str(value)))], {})


def secret_file(directory: Path) -> Path:
    """A run's secret for processes started by hand, as the orchestrator makes one (0600)."""
    from app.exchange import secret

    return secret.make(directory / "secret")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def session_secret() -> str:
    """One run's secret for the jobs the tests start by hand (each on its own port and
    directories): made once, 0600, removed when the tests end."""
    directory = Path(tempfile.mkdtemp(prefix="psc-test-secret-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return str(secret_file(directory))


def app_env(**extra: str) -> dict[str, str]:
    """The test process's environment without PSC_* (so defaults are the app's own), but for
    PSC_SECRET_FILE: the session's secret, as the orchestrator hands one to every process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSC_")}
    inherited = os.environ.get("PYTHONPATH", "")  # a host's own packages (bench/card/run.sh)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), inherited])), PSC_SECRET_FILE=session_secret(), **extra
    )
    return env


def run_app(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, fork: bool = True
) -> subprocess.CompletedProcess:
    """`python -m app ARGS`, its output captured as text (`fork`: from tests/app/forkserver.py's
    server, torch already imported; False: exec'd as a user's shell would)."""
    env = app_env() if env is None else env
    if fork and forkserver.can_fork(env):
        return forkserver.run(list(args), env, REPO, timeout)
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )


def final_accuracy(stdout: str) -> float:
    """The one `Accuracy: ` line a finished rank 0 prints, as a number."""
    lines = [line for line in stdout.splitlines() if line.startswith("Accuracy: ")]
    assert len(lines) == 1, stdout
    return float(lines[0].split()[1])


def job_args(tmp_path: Path, world_size: int) -> list[str]:
    """What every process of a job on 127.0.0.1 shares: the world size, the rendezvous on a
    free port, the run's secret, and tmp_path's metrics and checkpoint directories."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    return [
        "--secret_file",
        str(tmp_path / "secret" if (tmp_path / "secret").exists() else secret_file(tmp_path)),
        "--world_size",
        str(world_size),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "--metrics_dir",
        str(tmp_path / "metrics"),
        "--checkpoint_dir",
        str(tmp_path / "checkpoints"),
    ]


@dataclass
class Process:
    name: str
    returncode: int
    stdout: str
    stderr: str


def start_app(
    tmp_path: Path,
    stem: str,
    argv: list[str],
    env: dict[str, str] | None = None,
    preexec_fn=None,
    fork: bool = True,
) -> subprocess.Popen | forkserver.ForkedApp:
    """`python -m app ARGV` in the background, its output in tmp_path/STEM.out and .err.
    `fork`: forked from tests/app/forkserver.py's server, torch already imported (~3 CPU-s less
    a process); False, or a `preexec_fn` (run in the child before the app, e.g. to set a signal's
    disposition): exec'd as a user's shell would."""
    with open(tmp_path / f"{stem}.out", "w") as out, open(tmp_path / f"{stem}.err", "w") as err:
        env = app_env() if env is None else env
        if fork and preexec_fn is None and forkserver.can_fork(env):
            return forkserver.start(argv, env, REPO, out.fileno(), err.fileno())
        return subprocess.Popen(
            [sys.executable, "-m", "app", *argv],
            stdout=out,
            stderr=err,
            env=env,
            cwd=REPO,
            preexec_fn=preexec_fn,
        )


def wait_for(procs: dict, timeout: float, what: str = "cluster") -> None:
    """Wait for every process; at `timeout` fail the test, and never leave one running."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs.values():
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish within {timeout} s")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def finished(tmp_path: Path, name: str, proc: subprocess.Popen, stem: str | None = None) -> Process:
    """An ended process with the output start_app saved under `stem` (default `name`)."""
    stem = stem or name
    return Process(
        name, proc.returncode, (tmp_path / f"{stem}.out").read_text(), (tmp_path / f"{stem}.err").read_text()
    )


def run_cluster(
    tmp_path: Path,
    workers: int,
    args: list[str],
    timeout: float,
    delays: dict[str, float] | None = None,
    shards: int = 1,
    env: dict[str, str] | None = None,
) -> dict[str, Process]:
    """Start `ps`, its shards `ps1..ps<shards-1>` and `worker1..N` on 127.0.0.1 (`delays`:
    seconds to wait before starting that process); wait for all, killing every one at `timeout`.
    `args` must hold `--shards` when `shards` > 1; `env`: every process's environment (default app_env())."""
    common = [*job_args(tmp_path, workers + 1), *args]
    roles = (
        {"ps": ["ps"]}
        | {f"ps{i}": ["ps", "--shard", str(i)] for i in range(1, shards)}
        | {f"worker{r}": ["worker", "--rank", str(r)] for r in range(1, workers + 1)}
    )
    procs = {}
    for name, role in roles.items():
        time.sleep((delays or {}).get(name, 0.0))
        procs[name] = start_app(tmp_path, name, [*role, *common], env)
    wait_for(procs, timeout)
    return {name: finished(tmp_path, name, proc) for name, proc in procs.items()}


# --- TensorBoard's event files, read back -------------------------------------


def curves(directory: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of one event directory: [(step, value)], as TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected_curves(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The curves the JSON lines call for: per tag the last record of each step, in step order.
    A process that started again at step S (its `start` record) purged the earlier points past S
    (TensorBoard's `purge_step`) and wrote the steps after S again."""
    last: dict[str, dict[int, float]] = defaultdict(dict)
    for r in records:
        if r["event"] == "start":
            for points in last.values():
                for step in [s for s in points if s > r["step"]]:
                    del points[step]
        fields = {k: v for k, v in r.items() if k not in ("time", "role", "rank", "event", "step")}
        from app.training.event_files import scalars

        for tag, value in scalars(r["event"], fields).items():
            last[tag][r["step"]] = value
    return {tag: sorted(points.items()) for tag, points in last.items()}


def assert_same_curves(got: dict, want: dict, where: str) -> None:
    assert sorted(got) == sorted(want), where
    for tag, points in want.items():
        steps = [s for s, _ in got[tag]]
        assert steps == sorted(set(steps)), f"{where} {tag}: a step twice or out of order: {steps}"
        assert steps == [s for s, _ in points], f"{where} {tag}"
        # TensorBoard keeps float32: each value is the record's, as a float32.
        assert [numpy.float32(v) for _, v in got[tag]] == [numpy.float32(v) for _, v in points], f"{where} {tag}"


def recording_channel(answer=None, overlap: bool = False):
    """A worker's channel (app.worker.channels.Channel) that is its own route
    (app.exchange.route.Route), whose model's side is a real route's (`.real`: its bind, seal,
    flip, staging and load) and whose pushes go nowhere: each is recorded in `.messages` and
    answered at once with `answer(message, version)` (by default a Reply of zeros, one version
    on), which the wait loads through `.load`; the pushes the trainer said its rank has still to
    make after each one, in `.to_go`; each push's gradient norm in `.norms` and the epoch's
    batches it said in `.epoch_batches`; whether the worker proved each one finite, in `.proven`."""
    from types import SimpleNamespace

    import torch

    from app.exchange.route import Pusher
    from app.exchange.socket_route import SocketRoute
    from app.exchange.wire import Reply

    def zeros(message, version):
        return Reply(torch.zeros(message.numel()), version + 1, 0, 0)

    class RecordingChannel:  # an app.worker.channels.Channel and an app.exchange.route.Route
        def __init__(self) -> None:
            self.name = "worker1"
            self.route = self
            # the model's side, as a worker's one PS process over the job's socket has it (a test may
            # set another route: app.exchange.shared_route)
            self.real = SocketRoute(Pusher(1, self.name, overlap=overlap))
            self.messages: list = []
            self.to_go: list[int] = []
            self.norms: list = []  # each push's gradient norm (train.clip_grad_norm), None without
            self.epoch_batches: list[int] = []
            self.proven: list[bool] = []  # each push: whether the worker proved its values finite

        def join(self):
            raise AssertionError("a recording channel joins no PS")

        def bind(self, model, flat, start, final, messages_here, ordered=True):
            self.real.bind(model, flat, start, final, messages_here, ordered)

        def backward(self):
            return self.real.backward()

        def seal(self, message):
            return self.real.seal(message)

        def push(self, outgoing, version, epoch=1, batch=0, samples=0, to_go=-1, epoch_batches=0):
            self.messages.append(outgoing.message)
            self.to_go.append(to_go)
            self.norms.append(None if outgoing.norm is None else float(outgoing.norm))
            self.proven.append(outgoing.finite())
            self.epoch_batches.append(epoch_batches)
            reply = (answer or zeros)(outgoing.message, version)
            return SimpleNamespace(wait=lambda: self._loaded(reply))

        def _loaded(self, reply):
            if isinstance(reply, Reply):
                self.load(reply)
            return reply

        def load(self, reply):
            self.real.load(reply)

        def finish(self, pushes):
            pass

        def leave(self, pushes):
            pass

        def share(self, finished):
            return None

    return RecordingChannel()


def started(trainer) -> None:
    """`trainer.start_from` the state its model has, at version 0 (as a join at the start)."""
    from app.exchange.wire import Progress, Start

    trainer.start_from(Start(trainer.flat.vector.clone(), 0, Progress(1, 0, 0)))


def ps_server(
    model,
    lr: float,
    momentum: float = 0.0,
    num_trainers: int = 1,
    *,
    weight_decay: float = 0.0,
    staleness_lr: bool = False,
    part: tuple[int, int] | None = None,
    max_trainers: int = 0,
    join_timeout: float = float("inf"),
    run_id: str = "",
    strategy: str = "async",
    staleness: int = 0,
    **wiring,
):
    """A ParameterServer (app.ps.server) over `model` from keyword arguments, each given to the
    part's config it belongs to; `wiring`: the server's own (shared, clock, on_finish)."""
    from app.ps.members.members import MembersConfig
    from app.ps.policies import PolicyConfig
    from app.ps.server import ParameterServer, ServerConfig
    from app.ps.state import StateConfig

    config = ServerConfig(
        StateConfig(lr, momentum, weight_decay, staleness_lr, part),
        MembersConfig(num_trainers, max_trainers, join_timeout, run_id),
        PolicyConfig(strategy, staleness),
    )
    return ParameterServer(model, config, **wiring)


def submit(server, rank: int, message, pulled: int, name: str = "", **fields):
    """`server.submit` of `message` from `rank`, computed on version `pulled`; `fields`: the rest
    of its app.exchange.wire.Push (epoch, batch, samples, staleness, finite, ...)."""
    from app.exchange.wire import Push

    return server.submit(Push(rank, name, pulled, **fields), message)


def push(server, rank: int, message, pulled: int, name: str = "", **fields):
    """`submit`, waiting for its answer (a Reply or a Refusal)."""
    return submit(server, rank, message, pulled, name, **fields).wait()
