"""The command line's shared arguments and their types: a bad value is one line naming the
flag, what it got and what is allowed (argparse's exit status 2)."""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

from orchestrator.paths import DEFAULT_CONFIG


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


# shell completion (`ps-compose completion`, shtab): a flag whose value is a file completes file names
FILES = {"bash": "_shtab_compgen_files", "zsh": "_files"}


def completes_files(action: argparse.Action) -> argparse.Action:
    action.complete = FILES  # type: ignore[attr-defined]  # shtab reads it
    return action


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; must be a whole number >= 1") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"got {n}; must be at least 1")
    return n


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; must be a number > 0") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"got {text}; must be a number > 0")
    return x


def run_name(text: str) -> str:
    from orchestrator.topology.model import NAME_RULE, valid_name

    if not valid_name(text):
        raise argparse.ArgumentTypeError(f"got {text!r}; {NAME_RULE}")
    return text


def run_id_arg(text: str) -> str:
    """`--resume RUN_ID`'s run id (app.contract.RUN_ID); an override there was meant for the topology."""
    from app.contract import RUN_ID

    if "=" in text:
        raise argparse.ArgumentTypeError(
            f"got {text!r}, an override: give it before --resume, or the run id as --resume=RUN_ID"
        )
    if not RUN_ID.match(text):
        raise argparse.ArgumentTypeError(f"got {text!r}; must be a run id (letters, digits, '.', '_', '-')")
    return text


def add_resume_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=run_id_arg,
        metavar="RUN_ID",
        help="continue the newest unfinished checkpoint; with RUN_ID (`runs` lists them), that run, under its "
        "own id (default: a new run starts at version 0 and moves older checkpoints to checkpoints/previous/)",
    )


def add_name_arg(p: argparse.ArgumentParser, default: str = "the topology's name:") -> None:
    """`--name NAME` (`make ... NAME=`): the run's name, overriding the topology's `name:`."""
    p.add_argument(
        "--name",
        type=run_name,
        metavar="NAME",
        help=f"the run's name: its compose project (or stack), state volume and runs/NAME/ (default: {default})",
    )


def add_topology_args(p: argparse.ArgumentParser) -> None:
    """`-c CONFIG`, `--workers N`, `--strategy S` and `--name NAME`: every verb that works on a
    topology takes them."""
    completes_files(
        p.add_argument(
            "-c",
            "--config",
            default=DEFAULT_CONFIG,
            metavar="CONFIG",
            help=f"topology file (default: {DEFAULT_CONFIG})",
        )
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="number of workers, overriding workers.count (GPUs 0..N-1 unless listed)",
    )
    add_strategy_arg(p)
    add_name_arg(p)
    add_overrides_arg(p)


def add_overrides_arg(p: argparse.ArgumentParser) -> None:
    """KEY=VALUE ... after the flags (or after `--`): any key of the topology, Hydra's way
    (orchestrator/topology/overrides.py); applied before --workers, --strategy and --name."""
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override a key of the topology, e.g. train.lr=0.05 workers.count=3 (the value read as YAML; "
        "~KEY removes one), validated as the file is",
    )


def log_tail(text: str) -> str:
    """`--tail`: a count of lines (0 and up) or `all`, as compose takes it."""
    if text == "all" or (text.isdigit() and text.isascii()):
        return text
    raise argparse.ArgumentTypeError(f"got {text!r}; must be a whole number >= 0 or 'all'")


# compose's and docker's --since: a Go duration back from now (42m, 1h30m, 2.5h), a Unix
# timestamp (1733140800, 1733140800.5), or a date and time (YYYY-MM-DD, YYYY-MM-DDThh:mm:ssZ).
_DURATION = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?(?:ns|us|µs|ms|s|m|h))+")
_UNIX = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_DATE = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}(?:T[0-9]{2}:[0-9]{2}(?::[0-9]{2}(?:\.[0-9]+)?)?(?:Z|[+-][0-9]{2}:[0-9]{2})?)?"
)


def log_since(text: str) -> str:
    """`--since`: what `docker compose logs --since` takes."""
    if any(p.fullmatch(text) for p in (_DURATION, _UNIX, _DATE)):
        return text
    raise argparse.ArgumentTypeError(
        f"got {text!r}; must be a duration back from now (42m, 1h30m), a Unix timestamp or a date "
        "and time (YYYY-MM-DDThh:mm:ssZ)"
    )


def add_log_args(p: argparse.ArgumentParser) -> None:
    """`-t/--timestamps`, `-n/--tail N`, `--since X`: `docker compose logs`' flags, passed on."""
    p.add_argument("-t", "--timestamps", action="store_true", help="show timestamps (the engine's, per line)")
    p.add_argument("-n", "--tail", type=log_tail, metavar="N", help="the last N lines of each service (default: all)")
    p.add_argument(
        "--since",
        type=log_since,
        metavar="X",
        help="lines since X: a duration back from now (42m, 1h30m), a Unix timestamp or YYYY-MM-DDThh:mm:ssZ",
    )


def add_json_arg(p: argparse.ArgumentParser, what: str) -> None:
    """`--json` (`docker compose ps --format json`'s): one JSON document on stdout instead of the table."""
    p.add_argument("--json", action="store_true", help=f"{what} as one JSON document (stable keys, null where unknown)")


def add_strategy_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--strategy", metavar="S", help="async, sync, ssp or allreduce (DDP, no PS), overriding train.strategy"
    )


def load_topology(args: argparse.Namespace):
    """The topology named by `-c`, with its KEY=VALUE overrides, `--workers`, `--strategy` and
    `--name` applied."""
    from orchestrator.topology.model import load_with

    return load_with(
        args.config,
        workers=args.workers,
        strategy=getattr(args, "strategy", None),
        name=getattr(args, "name", None),
        overrides=getattr(args, "overrides", None) or (),
    )
