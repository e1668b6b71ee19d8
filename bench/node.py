"""One process of a bench case: `python -m bench.node SYSTEM ROLE PARAMS_JSON OUT_JSON`."""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings

APP_PATH_ENV = "BENCH_APP_PATH"  # a directory holding another copy of `app/` to measure

SYSTEMS = {
    "app": "bench.appdrive",
    "app-comm": "bench.appdrive",
    "app-overlap": "bench.appdrive",
    "app-bf16": "bench.appdrive",
    "app-comm-bf16": "bench.appdrive",
    "app-sharded": "bench.appdrive",
    "app-sync": "bench.appdrive",
    "ref": "bench.reference",
    "ref-uv": "bench.reference",
    "ref-tuned": "bench.reference",
    "gloo": "bench.gloo",
    "compute": "bench.baselines",
    "allreduce": "bench.baselines",
}


def main(argv: list[str]) -> int:
    system, role, params, out = argv
    warnings.filterwarnings("ignore", message="You are using a Backend")
    if os.environ.get(APP_PATH_ENV):
        sys.path.insert(0, os.environ[APP_PATH_ENV])
    module = importlib.import_module(SYSTEMS[system])
    entry = {"ps": getattr(module, "ps_main", None), "shard": getattr(module, "shard_main", None)}.get(
        role, module.worker_main
    )
    result = entry(json.loads(params))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # The result is written and the process has left its job: end without the interpreter's
    # teardown, where torch RPC's threads (the reference's) can abort the process ("terminate
    # called without an active exception", status -6) after the measured run is over.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
