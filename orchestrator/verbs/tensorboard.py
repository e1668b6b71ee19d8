"""TensorBoard on the app's event files (`make tensorboard`): the port, the address it
answers on, and for `make tensorboard LOCAL=1` the local process on runs/<name>/.

The app writes `<metrics_dir>/tensorboard/<run id>/<process>/` (app/contract.py `event_dir`);
TensorBoard shows every run under the directory it is given, so the default (the whole
`tensorboard/` directory) puts a topology's runs side by side, and a run id narrows it to one.
The verb is orchestrator/verbs/board.py; compose serves it as a profiled service of the project.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from app.contract import RUN_ID, TENSORBOARD_DIR
from orchestrator.errors import UsageError
from orchestrator.topology.model import Topology

DEFAULT_PORT = 6006  # TensorBoard's own
PORTS_TRIED = 100  # from the default on, when it is taken
HOST = "127.0.0.1"  # never published beyond this host
ANSWER_TIMEOUT = 120.0  # seconds for a starting TensorBoard to answer


def check_run(run: Optional[str]) -> str:
    """`run` (a run id, or '' / None: every run) if it can name a run's directory."""
    if run and not RUN_ID.fullmatch(run):
        raise UsageError(
            f"RUN={run!r}: a run id is 1 to 64 letters, digits, '.', '_' or '-', "
            "as `make up` prints it (==> run <id>: ...)"
        )
    return run or ""


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def choose_port(asked: Optional[int]) -> int:
    """`asked` if free on 127.0.0.1 (else one line), or the first free one from 6006 on."""
    if asked is not None:
        if not _free(asked):
            raise UsageError(
                f"PORT={asked}: taken on {HOST}; leave PORT unset and a free one from {DEFAULT_PORT} is used"
            )
        return asked
    for port in range(DEFAULT_PORT, DEFAULT_PORT + PORTS_TRIED):
        if _free(port):
            return port
    raise UsageError(f"no free port on {HOST} in {DEFAULT_PORT}..{DEFAULT_PORT + PORTS_TRIED - 1}; give one: PORT=N")


def url(port: int) -> str:
    return f"http://{HOST}:{port}/"


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(url(port) + "data/logdir", timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def wait_until_answers(port: int, timeout: float = ANSWER_TIMEOUT, alive=lambda: True) -> bool:
    """True once TensorBoard answers on `port`; False at `timeout` or once `alive()` is False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        if answers(port):
            return True
        time.sleep(0.5)
    return False


def local_logdir(t: Topology, run: str, runs_dir: str = "runs") -> Path:
    """Where `make local` runs of `t` keep their event files (orchestrator/verbs/local.py: runs/<name>/metrics)."""
    return Path(runs_dir) / t.name / "metrics" / TENSORBOARD_DIR / run


def argv(logdir: str, port: int, host: str, python: str = sys.executable) -> list[str]:
    """TensorBoard's command line; `--load_fast false`: its Python reader, which drops the
    points a restarted process superseded (the app's purge_step)."""
    return [python, "-m", "tensorboard.main", "--logdir", logdir, "--host", host, "--port", str(port),
            "--load_fast", "false"]  # fmt: skip


def run_local(t: Topology, run: Optional[str], port: Optional[int], runs_dir: str = "runs") -> int:
    """TensorBoard as a local process on the `make local` runs of `t`; Ctrl-C stops it."""
    run = check_run(run)
    logdir = local_logdir(t, run, runs_dir)
    if not logdir.is_dir():
        raise UsageError(f"{logdir}: no event files yet; `make local CONFIG=...` writes them (runs/{t.name}/metrics/)")
    chosen = choose_port(port)
    proc = subprocess.Popen(argv(str(logdir), chosen, HOST), stdout=subprocess.DEVNULL)  # its log: on stderr
    try:
        if not wait_until_answers(chosen, alive=lambda: proc.poll() is None):
            raise UsageError(f"tensorboard did not answer on {url(chosen)} (its log is above)")
        what = f"run {run}" if run else "every run"
        print(f"tensorboard: {url(chosen)} ({what} of {t.name}, {logdir}/); Ctrl-C stops it", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
