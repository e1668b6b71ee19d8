"""Command line: parse, dispatch, map errors to exit codes. No logic here.

Exit status: 0 ok; 2 bad input (`UsageError`: a flag, a config, a path),
one line on stderr; 1 a failure at run time.

A verb is a sub-parser with `set_defaults(run=FUNCTION)`, where FUNCTION takes
the parsed arguments and returns the exit status; see `_add_verbs`.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from orchestrator import UsageError

DEFAULT_CONFIG = "configs/default.yaml"
DEFAULT_OUTPUT = "compose.yaml"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; must be a whole number >= 1") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"got {n}; must be at least 1")
    return n


def add_topology_args(p: argparse.ArgumentParser) -> None:
    """`-c CONFIG` and `--workers N`: every verb that works on a topology takes them."""
    p.add_argument("-c", "--config", default=DEFAULT_CONFIG, metavar="CONFIG",
                   help=f"topology file (default: {DEFAULT_CONFIG})")
    p.add_argument("--workers", type=_positive_int, metavar="N",
                   help="number of workers, overriding workers.count (GPUs 0..N-1 unless listed)")


def load_topology(args: argparse.Namespace):
    """The topology named by `-c`, with `--workers` applied."""
    from orchestrator.topology import load

    t = load(args.config)
    if args.workers is None:
        return t
    return t.with_workers(args.workers, source=f"{args.config} with --workers {args.workers}")


def run_render(args: argparse.Namespace) -> int:
    from orchestrator import render as r

    t = load_topology(args)
    text = r.dump(r.render(t), t.name)
    for warning in r.security_warnings(t):
        print(f"warning: {warning}", file=sys.stderr)
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    try:
        r.write_atomic(args.output, text)
    except OSError as e:
        raise UsageError(f"-o {args.output}: cannot write: {e.strerror or e}") from None
    print(f"wrote {args.output}: ps + {t.workers.count} workers, image {t.image_tag}, project {r.project_name(t)}")
    return 0


def run_local(args: argparse.Namespace) -> int:
    from orchestrator.local import run

    return run(load_topology(args), source=args.config, keep_going=args.keep_going)


def _add_verbs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("render", help="write the compose file of a topology")
    add_topology_args(p)
    p.add_argument("-o", "--output", default=DEFAULT_OUTPUT, metavar="FILE",
                   help=f"output file, '-' for stdout (default: {DEFAULT_OUTPUT})")
    p.set_defaults(run=run_render)

    p = sub.add_parser("local", help="run the PS and the workers as local processes")
    add_topology_args(p)
    p.add_argument("--keep-going", action="store_true",
                   help="do not stop the other processes when one fails")
    p.set_defaults(run=run_local)

    # The container verbs: parse here, run in orchestrator/cluster.py. logs, status
    # and down without -c act on the cluster `up` started last (runs/current.json).
    def cluster():  # imported on use: `render` and `local` need no Docker SDK
        from orchestrator import cluster as c
        return c

    p = sub.add_parser("build", help="build the topology's image (Docker SDK, progress streamed)")
    add_topology_args(p)
    p.add_argument("--offline", action="store_true", help="FROM the debootstrap base, wheels from images/wheelhouse/")
    p.add_argument("-v", "--verbose", action="store_true", help="show every build output line")
    p.set_defaults(run=lambda a: cluster().build(a.config, a.workers, offline=a.offline, verbose=a.verbose))

    p = sub.add_parser("up", help="render if needed, build if the image is missing, start detached")
    add_topology_args(p)
    p.add_argument("--offline", action="store_true", help="build (if needed) on the offline path")
    p.set_defaults(run=lambda a: cluster().up(a.config, a.workers, offline=a.offline))

    for verb, text in (("down", "stop and remove the cluster (the volume with checkpoints and metrics stays)"),
                       ("logs", "follow every service's log, prefixed by service"),
                       ("status", "one line per service: state, exit code, last step, loss")):
        p = sub.add_parser(verb, help=text)
        p.add_argument("-c", "--config", metavar="CONFIG", help="topology file (default: the last `up`)")
        p.add_argument("--workers", type=_positive_int, metavar="N")
    sub.choices["down"].add_argument("-v", "--volumes", action="store_true", help="also remove the volume")
    sub.choices["down"].set_defaults(run=lambda a: cluster().down(a.config, a.workers, volumes=a.volumes))
    sub.choices["logs"].add_argument("--no-follow", action="store_true", help="print and return")
    sub.choices["logs"].set_defaults(run=lambda a: cluster().logs(a.config, a.workers, follow=not a.no_follow))
    sub.choices["status"].set_defaults(run=lambda a: cluster().status(a.config, a.workers))

    p = sub.add_parser("smoke", help="the CPU cluster end to end in containers; checks accuracy and exit codes")
    p.add_argument("-c", "--config", default="configs/cpu-smoke.yaml", metavar="CONFIG")
    p.add_argument("--workers", type=_positive_int, default=2, metavar="N")
    p.add_argument("--timeout", type=_positive_int, default=900, metavar="SECONDS")
    p.set_defaults(run=lambda a: cluster().smoke(a.config, a.workers, timeout=a.timeout))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m orchestrator",
                     description="Parameter-Server training cluster from a YAML topology.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True, parser_class=_Parser)
    _add_verbs(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
