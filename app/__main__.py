"""`python -m app ps|worker|health|check|export [flags]`: exit 0 done, 2 bad input, 1 run-time failure."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Sequence

from app import stops
from app.config import Config, UsageError, check_threads_env, parse
from app.contract import PS, strategy_of

HEALTH_TIMEOUT = 2.0
PS_SIGTERM_GRACE = 20.0


def health(config: Config) -> int:
    """0 when the main PS accepts a connection: its UNIX socket in --socket_dir (zmq), else its
    port on 127.0.0.1. Nothing is sent: the connection proves only that it listens."""
    try:
        if config.socket_dir:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(HEALTH_TIMEOUT)
                probe.connect(os.path.join(config.socket_dir, f"{PS}.sock"))
            return 0
        with socket.create_connection(("127.0.0.1", config.master_port), timeout=HEALTH_TIMEOUT):
            return 0
    except OSError:
        return 1


def usage_error(error: UsageError) -> int:
    """A mistake that fails the same way at every start: its one line, kept (app.stops); 2."""
    line = f"app: error: {error}"
    print(line, file=sys.stderr)
    stops.keep(os.environ, line)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] != ["health"] and (before := stops.said_before(os.environ)):
        print(f"{before} ({stops.AGAIN})", file=sys.stderr)
        return 0
    try:
        config = parse(args, os.environ)
        check_threads_env(os.environ)
    except UsageError as error:
        return usage_error(error)
    if config.role == "health":
        return health(config)

    # A PS's worker told to stop (a scale down) leaves with status 0 at any moment of its life:
    # at once before it joined, through the PS once joined (app.worker.process). A SIGTERM
    # while torch loads is held until the handler below is in place.
    ps_worker = config.role == "worker" and strategy_of(config.strategy).has_ps
    held: list[int] = []
    if ps_worker:
        signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
    # torch's C++ code (Gloo, under allreduce) warns on stderr each time a peer's connection
    # closes, which is every normal exit in a job whose members leave without waiting.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from app.runtime import lifecycle, logs, machine, words  # imports torch: only for the roles that need it

    logs.setup_logging()
    machine.keep_freed_memory()
    # The PS may be writing a checkpoint when SIGTERM comes (compose waits 30 s).
    grace = PS_SIGTERM_GRACE if config.role == "ps" else min(config.rpc_timeout, 5.0)
    if ps_worker:
        from app.exchange import group

        # its PS is told, so that it stops waiting for the rank (a scale down of a rank not joined yet)
        lifecycle.sigterm_exits_at_once(
            f"{config.name}: stopped (SIGTERM) before it joined the job; nothing to leave",
            farewell=lambda: group.say_not_joining(config),
        )
    lifecycle.handle_sigterm(grace, announce=not ps_worker)  # a worker's leave is its one line
    if held:
        os.kill(os.getpid(), signal.SIGTERM)
    machine.set_threads(machine.sharing_cpus(config))
    try:
        if config.role == "check":  # the connectivity check (app/connectivity.py)
            from app import connectivity

            return connectivity.run(config)
        if config.role == "export":  # a run's model out for plain PyTorch (app/export.py)
            from app import export

            return export.run(config)
        if config.role == "ps":
            from app.ps import process as ps_process

            return ps_process.run(config)
        if not strategy_of(config.strategy).has_ps:  # allreduce: DDP, no PS (app/allreduce/job.py)
            from app.allreduce import job as ddp

            return ddp.run(config)
        from app.worker import process as worker_process

        return worker_process.run(config)
    except UsageError as error:
        return usage_error(error)
    except (SystemExit, Exception) as error:
        if ps_worker and lifecycle.sigterm_received():  # told to stop: what broke on the way out is no failure
            said = f": {type(error).__name__}: {words.first_line(error)}" if isinstance(error, Exception) else ""
            logs.log.info("%s: stopped (SIGTERM)%s", config.name, said)
            return 0
        if isinstance(error, SystemExit):
            raise
        # a failure at run time: one line, status 1
        logs.log.error("%s failed: %s: %s", config.name, type(error).__name__, words.first_line(error))
        logs.log.debug("traceback", exc_info=True)
        # Exit now: tearing threads down after a lost peer takes seconds, and nothing is
        # left to save.
        lifecycle.exit_now(1)
        return 1
    finally:
        lifecycle.run_cleanups()


if __name__ == "__main__":
    sys.exit(main())
