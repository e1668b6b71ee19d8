"""What every test folder shares: which tests may run side by side.

`make test` runs the suite on pytest-xdist workers with `--dist loadgroup`. A test marked
`docker` is in an engine group: `engine` unless it names another whose name starts with
`engine` (`@pytest.mark.xdist_group("engine-2")`). The tests of one engine group run one
after the other on one worker, in collection order, each group on a worker of its own; the
largest groups are handed out first (xdist's loadscope order), so they start at once. The
other tests (processes on ephemeral ports, temporary directories, no engine) run on
whichever worker is free.

Two groups, so two clusters at most at a time: a cpu-smoke run is held up by its RPC round
trips, not by the cores (as processes it kept 0.6 of a 2-core CPU VM's 2 cores busy on
average), so two side by side take little longer than one, and the bounds some tests hold
(docs/testing.md) keep their margin. Each group's tests use project names of their own;
what changes the engine itself (a swarm init, the doctor's view of it) stays in `engine`.

The swarm test of `engine` leaves the swarm it made only while no test of another group has
a project up (tests/engine_networks.py: `docker swarm leave` drops the names of every bridge
network of the moment): each docker test outside `engine` holds the engine's networks in use
while it runs (`engine_networks_in_use`), a module fixture that keeps a project up across its
tests holds them for the module.

A docker test in a group whose name does not start with `engine` fails. Without xdist
(one file run on its own) the marks change nothing. tests/test_side_by_side.py checks that the
grouping holds.
"""

from __future__ import annotations

import os

import pytest
from engine_networks import using_networks

# torch in a test's own process computes on one thread (unless OMP_NUM_THREADS says otherwise),
# as the app's processes on a 2-core host do (app.runtime.machine.set_threads): the pytest-xdist workers
# share the cores with each other and with the clusters the tests start. With two threads each,
# a test's tensor work took a third more CPU time on a loaded 2-core CPU VM (each parallel
# region's threads spin at its end while the other core is busy). Set before any test imports
# torch: its OpenMP reads the variable once, when it loads. The processes a test starts inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ENGINE_GROUP = "engine"
MISPLACED = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("docker") is None:
            continue
        named = [m.args[0] if m.args else m.kwargs.get("name") for m in item.iter_markers("xdist_group")]
        other = [str(name) for name in named if not str(name).startswith(ENGINE_GROUP)]
        if other:
            item.stash[MISPLACED] = f"marked docker, so in an engine group; not in {other[0]}"
        if not named:
            item.add_marker(pytest.mark.xdist_group(ENGINE_GROUP))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if MISPLACED in item.stash:
        pytest.fail(item.stash[MISPLACED], pytrace=False)


@pytest.fixture(autouse=True)
def engine_networks_in_use(request: pytest.FixtureRequest):
    """A docker test outside the group `engine` holds the host engine's networks in use while
    it runs: the swarm test of that group leaves its swarm only when no one does
    (tests/engine_networks.py: a leave drops the names of every bridge network there)."""
    groups = [m.args[0] if m.args else m.kwargs.get("name") for m in request.node.iter_markers("xdist_group")]
    if request.node.get_closest_marker("docker") is None or ENGINE_GROUP in groups:
        yield
        return
    with using_networks():
        yield


@pytest.fixture(autouse=True)
def words_of_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test sees the hints in make's words (`make up NAME=x`), as `make test` and the
    Makefile's verbs give them, whether pytest runs under make or not; a test of the
    command's own words (orchestrator/hints.py) removes the variable."""
    monkeypatch.setenv("PSC_VIA_MAKE", "1")
