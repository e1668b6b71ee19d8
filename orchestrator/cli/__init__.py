"""Command line: parse, dispatch, map errors to exit codes. No logic here.

Exit status: 0 ok; 2 bad input (`UsageError`: a flag, a config, a path),
one line on stderr; 1 a failure at run time.

A verb is a sub-parser with `set_defaults(run=FUNCTION)`, where FUNCTION takes
the parsed arguments and returns the exit status; see `_add_verbs`. The verbs on a
cluster (build, and each target's up, down, logs, status, smoke, scale, tensorboard,
export) are parsed in orchestrator/cli/cluster.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from orchestrator.arguments import (
    Parser,
    add_name_arg,
    add_resume_arg,
    add_topology_args,
    load_topology,
    positive_float,
    positive_int,
    run_id_arg,
)
from orchestrator.cli.cluster import add_build_verb, add_cluster_verbs
from orchestrator.errors import UsageError, engine_errors
from orchestrator.paths import DEFAULT_CONFIG


def targets():
    """The registry of targets (orchestrator/backends/registry.py), imported on use."""
    from orchestrator.backends import registry

    return registry


def run_render(args: argparse.Namespace) -> int:
    from orchestrator.host_paths import check_paths
    from orchestrator.render.yamlio import write_atomic
    from orchestrator.topology.services import describe

    backend = targets().get(args.target)
    t = load_topology(args)
    check_paths(t, args.config, Path.cwd())  # `code` and train.init_weights: before anything is written
    text = backend.render(t, data_root=os.getcwd())
    for warning in backend.warnings(t):
        print(f"warning: {warning}", file=sys.stderr)
    output = args.output or backend.output
    if output == "-":
        sys.stdout.write(text)
        return 0
    try:
        write_atomic(output, text)
    except OSError as e:
        raise UsageError(f"-o {output}: cannot write: {e.strerror or e}") from None
    print(f"wrote {output}: {describe(t)}, image {t.image_tag}, {backend.noun} {backend.name_of(t)}")
    return 0


def run_doctor(args: argparse.Namespace) -> int:
    from orchestrator.doctor.checks import run_checks
    from orchestrator.doctor.facts import gather
    from orchestrator.doctor.report import report
    from orchestrator.topology.services import describe

    backend = targets().get(args.target)
    t = load_topology(args)
    print(f"doctor: {args.config}, {describe(t)}, target {backend.name}")
    facts = gather(t, engine=backend.engine, probe=not args.no_probe, target=backend.gather_facts)
    return 0 if report(run_checks(backend.checks(), t, facts), sys.stdout) else 1


def run_gpu_trial(args: argparse.Namespace) -> int:
    from orchestrator.verbs import gpu_trial

    return engine_errors(gpu_trial.run)(args.config, seconds=args.seconds)


def run_schema(args: argparse.Namespace) -> int:
    import json

    from orchestrator import reference_doc as reference
    from orchestrator.topology.model import Topology

    text = (
        reference.topology_reference_markdown()
        if args.markdown
        else json.dumps(Topology.model_json_schema(), indent=2) + "\n"
    )
    sys.stdout.write(text)
    return 0


def run_local(args: argparse.Namespace) -> int:
    from orchestrator.verbs import inventory
    from orchestrator.verbs.local import run

    t = load_topology(args)
    if isinstance(args.resume, str):  # --resume RUN_ID: a run of the name that did not finish
        inventory.check_local_resume(t.name, args.resume, args.runs_dir)
    code = run(
        t,
        source=args.config,
        keep_going=args.keep_going,
        resume=args.resume,
        runs_dir=args.runs_dir,
        run_id=args.run_id or "",
    )
    if code < 128:  # not stopped by a signal: the run's report, and its PNGs to MLflow where it was tracked
        from orchestrator.metrics import end_report

        tracked = os.environ.get("MLFLOW_TRACKING_URI", "")
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or t.name
        end_report.after_run(Path(args.runs_dir) / t.name / "metrics", sys.stdout, "local:", tracked, experiment)
    return code


def _add_document_verbs(sub: argparse._SubParsersAction) -> None:
    """render and schema: the topology as a document, or as its own schema."""
    registry = targets()
    outputs = ", ".join(f"{b.output} with --target {b.name}" for b in registry.BACKENDS.values())
    p = sub.add_parser("render", help="write the compose file (or a stack file, or Kubernetes manifests) of a topology")
    add_topology_args(p)
    p.add_argument("-o", "--output", metavar="FILE", help=f"output file, '-' for stdout (default: {outputs})")
    p.add_argument(
        "--target",
        choices=list(registry.BACKENDS),
        default=registry.DEFAULT,
        help=" or ".join(b.summary for b in registry.BACKENDS.values()),
    )
    p.set_defaults(run=run_render)
    p = sub.add_parser("schema", help="the topology's JSON Schema, or with --markdown its reference (docs/topology.md)")
    p.add_argument(
        "--markdown", action="store_true", help="the reference as Markdown, generated from the field docstrings"
    )
    p.set_defaults(run=run_schema)


def _add_host_verbs(sub: argparse._SubParsersAction) -> None:
    """doctor and gpu-check: this host, for a topology."""
    registry = targets()
    p = sub.add_parser("doctor", help="check this host before a run: one line per check, exit 0 only if all pass")
    add_topology_args(p)
    p.add_argument(
        "--target",
        choices=list(registry.BACKENDS),
        default=registry.DEFAULT,
        help=f"what the run uses (default: {registry.DEFAULT})",
    )
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="cuda: skip the probe container (the project's image, its GPUs, uid 1000)",
    )
    p.set_defaults(run=run_doctor)
    p = sub.add_parser(
        "gpu-check",
        help="doctor with the probe, then a one-minute cnn run with one worker per GPU: "
        "samples/s, GPU name and UUID per worker",
    )
    p.add_argument(
        "-c",
        "--config",
        default=DEFAULT_CONFIG,
        help=f"the cuda topology whose image and group_add to use (default: {DEFAULT_CONFIG})",
    )
    p.add_argument(
        "--seconds", type=positive_int, default=60, metavar="SECONDS", help="how long the run trains (default: 60)"
    )
    p.set_defaults(run=run_gpu_trial)


def _add_local_verbs(sub: argparse._SubParsersAction) -> None:
    """local and sample-data: no engine."""
    p = sub.add_parser("local", help="run the PS and the workers as local processes")
    add_topology_args(p)
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="do not stop the other processes when one fails for good (a worker: after its restarts)",
    )
    p.add_argument(
        "--runs-dir",
        default="runs",  # orchestrator.verbs.local.RUNS_DIR
        metavar="DIR",
        help="where the run's directory <name>/ goes: checkpoints, metrics, its state (default: runs)",
    )
    p.add_argument(
        "--run-id",
        type=run_id_arg,
        metavar="RUN_ID",
        help="the new run's id (default: a new one; with --resume and no RUN_ID, the run that continues)",
    )
    add_resume_arg(p)
    p.set_defaults(run=run_local)
    p = sub.add_parser(
        "sample-data",
        help="write a small Imagenette-layout image tree (train/, val/) from "
        "scikit-learn's digits, for configs/cpu-resnet.yaml",
    )
    p.add_argument(
        "-o",
        "--out",
        default="data/sample-imagenette",
        metavar="DIR",
        help="where the tree goes (default: data/sample-imagenette, configs/cpu-resnet.yaml's data_dir)",
    )
    p.add_argument("--size", type=positive_int, default=32, metavar="PIXELS", help="image side (default: 32)")
    p.set_defaults(run=lambda a: _sample_data().run(a.out, a.size))


def _add_verbs(sub: argparse._SubParsersAction) -> None:
    _add_document_verbs(sub)
    _add_host_verbs(sub)
    _add_local_verbs(sub)
    add_build_verb(sub)
    for backend in targets().BACKENDS.values():
        if backend.verb_prefix is not None:
            add_cluster_verbs(sub, backend)
    _add_check_verb(sub)
    _add_runs_verb(sub)
    _add_chaos_verb(sub)
    _add_report_verbs(sub)
    _add_completion_verb(sub)


def _add_completion_verb(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "completion",
        help="the shell completion of ps-compose's verbs, flags and files, for bash or zsh: "
        "`source <(ps-compose completion bash)`, or write it where the shell reads completions",
    )
    p.add_argument("shell", choices=["bash", "zsh"])
    p.set_defaults(run=run_completion)


def run_completion(args: argparse.Namespace) -> int:
    """The script shtab makes of this command line's parsers (the verbs and flags as they are
    now), for the `ps-compose` command."""
    import shtab

    parser = build_parser()
    parser.prog = "ps-compose"
    sys.stdout.write(shtab.complete(parser, shell=args.shell))
    return 0


def _sample_data():
    from orchestrator import sample_data

    return sample_data


def _add_runs_verb(sub: argparse._SubParsersAction) -> None:
    """Every run this host knows: list, show one, remove one (orchestrator/verbs/inventory.py)."""
    from orchestrator.verbs import inventory

    p = sub.add_parser(
        "runs",
        help="every run this host knows (local, compose, swarm): name, run id, target, state, started, "
        "steps, metric, where its state lives; `runs show`, `runs rm`",
    )
    inventory.add_arguments(p, ["local", *(b.name for b in targets().BACKENDS.values() if b.verb_prefix is not None)])


def _add_check_verb(sub: argparse._SubParsersAction) -> None:
    """The connectivity check (orchestrator/verbs/check.py, app/connectivity.py)."""

    @engine_errors
    def run_check(a: argparse.Namespace) -> int:
        from orchestrator.verbs import check

        return check.run(
            load_topology(a),
            local=a.local,
            timeout=a.timeout,
            without=a.without or (),
            build=a.build,
            offline=a.offline,
        )

    p = sub.add_parser(
        "check",
        help="send a tensor from rank 0 to every rank and back over the cluster's "
        "network; one line per rank (round trip, GB/s); a missing rank fails with its name",
    )
    add_topology_args(p)
    p.add_argument("--local", action="store_true", help="as processes on 127.0.0.1 instead of containers")
    p.add_argument(
        "--timeout",
        type=positive_int,
        default=30,
        metavar="SECONDS",
        help="how long rank 0 waits for every rank to register (default: 30)",
    )
    p.add_argument(
        "--without",
        action="append",
        metavar="SERVICE",
        help="leave this service out (the check then fails naming it); repeatable",
    )
    p.add_argument("--build", action="store_true", help="(re)build the image first (else only when missing)")
    p.add_argument("--offline", action="store_true", help="build (if needed) on the offline path")
    p.set_defaults(run=run_check)


def _add_chaos_verb(sub: argparse._SubParsersAction) -> None:
    """Faults injected into a CPU run (orchestrator/chaos/), then a table of how it recovered."""

    def run_chaos(a: argparse.Namespace) -> int:
        from orchestrator.chaos import registry

        return registry.run(
            a.scenario,
            Path(a.runs),
            containers=not a.no_containers,
            minutes=a.minutes,
            seed=a.seed,
            seeds=a.seeds,
            project=a.name,
            faults=a.faults,
        )

    p = sub.add_parser("chaos", help="kill workers, the PS, checkpoint writes; print fault, recovered, time, accuracy")
    p.add_argument(
        "scenario", nargs="*", help="scenarios to run (default: all), or `soak` alone: random faults, then invariants"
    )
    p.add_argument("--no-containers", action="store_true", help="only the process scenarios (no Docker)")
    p.add_argument("--minutes", type=positive_float, default=10.0, help="soak: minutes of faults (default: 10)")
    p.add_argument(
        "--faults",
        type=positive_int,
        default=0,
        metavar="N",
        help="soak: at least N faults, even past --minutes when recoveries are slow (default: the minutes decide)",
    )
    seeding = p.add_mutually_exclusive_group()
    seeding.add_argument(
        "--seed", type=positive_int, help="soak: the seed of its faults (default: a random one, printed)"
    )
    seeding.add_argument(
        "--seeds",
        type=positive_int,
        metavar="K",
        help="soak: K soaks one after another, each with a random seed, then one table (seed, faults, invariants)",
    )
    add_name_arg(p, "soak: a project of its own, psc-soak-<6 hex digits>")
    p.add_argument("--runs", default="runs/chaos", metavar="DIR", help="logs and metrics of each scenario")
    p.set_defaults(run=run_chaos)


def _add_report_verbs(sub: argparse._SubParsersAction) -> None:
    """Plots of runs' metrics and the strategies side by side (orchestrator/metrics/)."""

    def report():
        from orchestrator.metrics import report

        return report

    def compare():
        from orchestrator.metrics import compare

        return compare

    p = sub.add_parser("report", help="PNG plots (loss, accuracy, samples/s, staleness) and a summary of runs' metrics")
    report().add_arguments(p)
    p.set_defaults(run=lambda a: report().run_cli(a))
    p = sub.add_parser("compare", help="the CPU job under each strategy as local processes; one report, one table")
    compare().add_arguments(p, positive_int)
    p.set_defaults(run=lambda a: compare().run_cli(a))


def _version() -> str:
    """The installed ps-compose's version (pyproject.toml)."""
    from importlib import metadata

    try:
        return metadata.version("ps-compose")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    installed = os.path.basename(sys.argv[0]) == "ps-compose"  # pyproject.toml's [project.scripts]
    parser = Parser(
        prog="ps-compose" if installed else "python -m orchestrator",
        description="Parameter-Server training cluster from a YAML topology.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True, parser_class=Parser)
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
