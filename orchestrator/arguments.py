"""The command line's shared arguments and their types: a bad value is one line naming the
flag, what it got and what is allowed (argparse's exit status 2)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from orchestrator.paths import DEFAULT_CONFIG


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


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
    p.add_argument(
        "-c", "--config", default=DEFAULT_CONFIG, metavar="CONFIG", help=f"topology file (default: {DEFAULT_CONFIG})"
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
