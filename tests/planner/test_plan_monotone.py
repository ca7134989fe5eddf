"""Plans are monotone in the budget: for every solver, more memory never gives a plan predicted to
cost more (NOTE [monotone plans]), from the smallest feasible peak to past the plain peak."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plans import _traced, assert_monotone

from remat.planner import plan_trace
from remat.planner.api import plan_at
from remat.planner.frontier import Frontier, frontier
from remat.planner.solvers import names

MODELS = ["mlp", "gpt2", "cnn"]
# six rungs of MILPs per model: a coarser DAG and a shorter limit than the other tests' MILP
QUICK_MILP = {"time_limit": 2.0, "max_nodes": 8}


@functools.cache
def _frontier(name: str, solver: str) -> Frontier:
    trace, _, _ = _traced(name)
    options: dict[str, Any] = QUICK_MILP if solver == "milp" else {}
    return frontier(trace, solver, **options)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("solver", names())
@settings(max_examples=10, deadline=None)
@given(fractions=st.lists(st.floats(0.0, 1.2), min_size=2, max_size=6))
def test_more_budget_never_gives_a_costlier_plan(name: str, solver: str, fractions: list[float]) -> None:
    found = _frontier(name, solver)
    assert_monotone(found, name, fractions)


@pytest.mark.parametrize("name", ["gpt2", "cnn"])
def test_spare_budget_buys_a_cheaper_plan(name: str) -> None:
    """Between the smallest feasible peak and the plain peak the chain solver's plans are not one
    plan: budgets in between get plans that recompute less."""
    found = _frontier(name, "chain")
    _, base, low = _traced(name)
    overheads = {plan_at(found, low + (base - low) * k // 4).predicted_overhead for k in range(5)}
    assert len(overheads) >= 3, overheads
    assert plan_at(found, base).predicted_overhead == 1.0


def test_plan_trace_picks_from_the_frontier() -> None:
    trace, base, low = _traced("mlp")
    budget = (low + base) // 2
    plan, picked = plan_trace(trace, budget), plan_at(frontier(trace), budget)
    assert (plan.regions, plan.predicted_overhead) == (picked.regions, picked.predicted_overhead)
