"""The benches' case processes (`python -m bench.node`) forked from tests/app/forkserver.py's
server (torch imported once), as the app tests' are: the same processes, ~3 CPU-s less each.
The benches' other processes (the published example, `make local`, the bench gpu's and cuda's
app processes, which the CPU sampler finds by their command line) are exec'd."""

import pytest


@pytest.fixture(autouse=True)
def forked_case_processes(monkeypatch):
    import forkserver

    from bench import procs

    monkeypatch.setattr(procs, "popen", forkserver.popen)
