"""app.contract.Strategy: what each strategy is, asked by property everywhere (the PS, the
worker, the render), never by name; the option's rules agree with it."""

from __future__ import annotations

import pytest

from app.config import UsageError, parse
from app.contract import PS_STRATEGIES, STRATEGIES, strategy_of


def test_each_strategy_is_what_docs_strategies_says():
    described = {
        name: (s.has_ps, s.rounds, s.bounded, s.waits, s.allows_overlap)
        for name in STRATEGIES
        for s in [strategy_of(name)]
    }
    assert described == {
        "async": (True, False, False, False, True),
        "sync": (True, True, False, True, False),
        "ssp": (True, False, True, True, True),
        "allreduce": (False, False, False, False, False),
    }
    assert sorted(PS_STRATEGIES) == sorted(n for n in STRATEGIES if strategy_of(n).has_ps)


def test_a_name_that_is_no_strategy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="one of async, sync, ssp, allreduce"):
        strategy_of("hogwild")


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_options_rule_for_overlap_is_the_descriptors(name):
    argv = ["worker", "--strategy", name, "--overlap", "true"]
    if strategy_of(name).allows_overlap:
        assert parse(argv, {}).overlap is True
    else:
        with pytest.raises(UsageError, match="overlap"):
            parse(argv, {})
