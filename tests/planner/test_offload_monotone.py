"""Three-way plans are monotone in the budget too: with a link, more memory never gives a plan
predicted to cost more (NOTE [monotone plans]), from below recomputation's smallest peak to past
the plain peak, because the offload candidates are found once (``offload_frontier``) and a budget
picks the cheapest that fits."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plans import _traced, assert_monotone

import remat
from remat.planner.api import plan_at
from remat.planner.frontier import Frontier, frontier
from remat.planner.offload_search import offload_frontier

LINKS = {"fast": remat.Link(d2h=1e18, h2d=1e18, latency=0), "2GB/s": remat.Link("2GB/s", "2GB/s")}


@functools.cache
def _frontier(name: str, link: str) -> Frontier:
    trace, _, _ = _traced(name)
    return offload_frontier(frontier(trace, "auto"), LINKS[link], None, "offload_greedy")


@pytest.mark.parametrize("name", ["gpt2", "cnn"])
@pytest.mark.parametrize("link", sorted(LINKS))
@settings(max_examples=15, deadline=None)
@given(fractions=st.lists(st.floats(-0.3, 1.2), min_size=2, max_size=6))
def test_more_budget_never_gives_a_costlier_three_way_plan(
    name: str, link: str, fractions: list[float]
) -> None:
    found = _frontier(name, link)
    assert_monotone(found, name, fractions)


@pytest.mark.parametrize("name", ["gpt2", "cnn"])
def test_the_offload_frontier_reaches_below_recomputation_and_keeps_its_plans(name: str) -> None:
    """At every budget the three-way pick is never costlier than recomputation's, and a fast link
    reaches budgets recomputation cannot."""
    _, base, low = _traced(name)
    alone, both = frontier(_traced(name)[0], "auto"), _frontier(name, "fast")
    for k in range(5):
        budget = low + (base - low) * k // 4
        assert plan_at(both, budget).predicted_overhead <= plan_at(alone, budget).predicted_overhead
    assert min(c.pred.peak_bytes for c in both.candidates) < low
