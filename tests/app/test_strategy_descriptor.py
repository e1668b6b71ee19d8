"""app.contract.Strategy: what each strategy is, asked by property everywhere (the PS, the
worker, the render), never by name; the option's rules agree with it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.config import UsageError, parse
from app.contract import PS_STRATEGIES, STRATEGIES, strategy_of
from app.ps.policies import AsyncPolicy, BoundedPolicy, RoundPolicy

from app_testkit import ps_server, submit


def test_each_strategy_is_what_docs_strategies_says():
    described = {
        name: (s.has_ps, s.rounds, s.bounded, s.waits, s.allows_overlap, s.local)
        for name in STRATEGIES
        for s in [strategy_of(name)]
    }
    assert described == {
        "async": (True, False, False, False, True, False),
        "sync": (True, True, False, True, False, False),
        "ssp": (True, False, True, True, True, False),
        "allreduce": (False, False, False, False, False, False),
        "diloco": (True, True, False, True, False, True),
        "diloco_async": (True, False, False, False, False, True),
    }
    assert sorted(PS_STRATEGIES) == sorted(n for n in STRATEGIES if strategy_of(n).has_ps)


def test_a_name_that_is_no_strategy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="one of async, sync, ssp, allreduce, diloco, diloco_async"):
        strategy_of("hogwild")


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_options_rule_for_overlap_is_the_descriptors(name):
    argv = ["worker", "--strategy", name, "--overlap", "true"]
    if strategy_of(name).allows_overlap:
        assert parse(argv, {}).overlap is True
    else:
        with pytest.raises(UsageError, match="overlap"):
            parse(argv, {})


def test_each_ps_strategy_runs_its_own_policy_in_the_ps():
    """async answers at once, ssp holds a reply past its bound (1 here), sync holds every reply until the
    round closes: each in its policy class, picked from the descriptor."""
    servers = {
        name: ps_server(nn.Linear(2, 1), lr=1.0, momentum=0.0, num_trainers=2, strategy=name, staleness=1)
        for name in PS_STRATEGIES
    }
    assert {name: type(s.policy) for name, s in servers.items()} == {
        "async": AsyncPolicy,
        "ssp": BoundedPolicy,
        "sync": RoundPolicy,
        "diloco": RoundPolicy,
        "diloco_async": AsyncPolicy,
    }
    for name, server in servers.items():
        for rank in (1, 2):
            server.join(rank, f"worker{rank}")
        first = submit(server, 1, torch.ones(3), 0)
        assert first.done() is (not strategy_of(name).rounds)  # ssp: one push ahead is within its bound
        held = submit(server, 1, torch.ones(3), server.version)  # rank 1 leads rank 2 by two pushes now
        assert held.done() is (not strategy_of(name).waits), name
