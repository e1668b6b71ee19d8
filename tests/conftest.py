"""What every test folder shares: which tests may run side by side.

`make test` runs the suite on pytest-xdist workers with `--dist loadgroup`. Every test
marked `docker` joins the group `engine`: they run one after the other on one worker, in
collection order, so that no two clusters share the engine's cores, names or ports at once
and the timing bounds some of them hold (docs/testing.md) are not squeezed by a second
cluster. The other tests (processes on ephemeral ports, temporary directories, no engine)
run on whichever worker is free, beside the engine's. The largest group is handed out
first (xdist's loadscope order), so the engine's tests start at once.

A test may name a group of its own with `@pytest.mark.xdist_group("name")`, but not one
marked `docker` (xdist would make a group of both names, beside `engine`): such a test
fails. Without xdist (`pytest tests/x.py`) the marks change nothing.
tests/test_side_by_side.py checks that the grouping holds.
"""

from __future__ import annotations

import pytest

ENGINE_GROUP = "engine"
MISPLACED = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("docker") is None:
            continue
        own = [m.args[0] if m.args else m.kwargs.get("name") for m in item.iter_markers("xdist_group")]
        if own:
            item.stash[MISPLACED] = f"marked docker, so in the group {ENGINE_GROUP}; not also {own[0]}"
        item.add_marker(pytest.mark.xdist_group(ENGINE_GROUP))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if MISPLACED in item.stash:
        pytest.fail(item.stash[MISPLACED], pytrace=False)
