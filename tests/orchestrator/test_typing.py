"""Each option is declared once, as a field of app/options.py's dataclasses, in source a type
checker reads (`make lint` runs mypy): the app's Config and the topology's train and ps sections
are those dataclasses, with no class built at run time and no stub beside them."""

from __future__ import annotations

import dataclasses

from app import config, option_table, options
from orchestrator.topology import option_sections

from orch_helpers import REPO


def test_the_project_writes_no_typing_stub() -> None:
    stubs = [p.relative_to(REPO) for top in ("app", "orchestrator", "bench") for p in (REPO / top).rglob("*.pyi")]
    assert stubs == []


def test_the_config_is_every_option_and_the_role() -> None:
    names = [f.name for f in dataclasses.fields(config.Config)]
    assert sorted(names) == sorted([o.name for o in option_table.OPTIONS] + ["role"])


def test_the_topology_sections_are_the_option_dataclasses_with_their_own_keys() -> None:
    for section, base, own in (
        (option_sections.Train, options.TrainOptions, ["data_dir", "init_weights"]),
        (option_sections.PS, options.PSOptions, ["shm_size", "gpu", "rpc_port"]),
    ):
        assert issubclass(section, base)
        assert [f.name for f in dataclasses.fields(section)] == [f.name for f in dataclasses.fields(base)] + own
        # every field declared in a class body (what a type checker reads), none added at run time
        declared = {n for cls in section.__mro__ for n in getattr(cls, "__annotations__", {})}
        assert {f.name for f in dataclasses.fields(section)} <= declared
