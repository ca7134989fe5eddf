"""remat.dynamic trains exactly like the plain model, within its budget, deciding as the simulator.

Each workload trains three SGD steps (momentum, so the optimizer has state) with the whole step,
optimizer included, inside a region. Budgets come from the simulator: the region's own trace at no
budget is replayed on a ladder of budgets, and the smallest one under which every step runs without
thrashing is the smallest feasible budget. Costs come from the cost model (``cost="model"``) so
that the decisions, and hence the budgets that work, do not depend on timing noise.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from dynamic_models import Result, assert_same, copies, train
from torch import nn

import remat
from remat.dynamic import Dynamic, DynamicStats
from remat.sim.result import Outcome
from remat.sim.simulate import simulate

POLICIES = ["dtr", "dte", "coop"]
BACKENDS = ["accounting", "arena"]
LADDER = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


class Steps:
    """A region factory for ``train``: one region per step, registering the model and the
    optimizer first; keeps each step's stats."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.stats: list[DynamicStats] = []

    @contextlib.contextmanager
    def __call__(self, model: nn.Module, opt: torch.optim.Optimizer) -> Iterator[Dynamic]:
        region = remat.dynamic(keep=(model, opt), cost="model", **self.options)
        with region:
            yield region
        self.stats.append(region.stats)


@functools.cache
def reference(name: str, backend: str = "accounting") -> tuple[Result, tuple[DynamicStats, ...]]:
    """The plain run, and the stats of the same run in regions with room for everything (the arena
    places a few outputs differently, so autograd copies a few more gradients: its own traces)."""
    plain, copy, batch = copies(name)
    result = train(plain, batch, None)
    budget = None if backend == "accounting" else 2 * max(s.peak_bytes for s in reference(name)[1])
    free = Steps(budget=budget, policy="dtr", backend=backend)
    assert_same(result, train(copy, batch, free))
    return result, tuple(free.stats)


@functools.cache
def smallest_budget(name: str, policy: str, backend: str = "accounting") -> int:
    """The least budget on the ladder under which the simulator runs every step of ``name``."""
    _, steps = reference(name, backend)
    peak = max(s.peak_bytes for s in steps)
    for ratio in LADDER:
        budget = int(ratio * peak)
        if all(simulate(s.trace, budget, policy, 3.0).outcome is Outcome.OK for s in steps):
            return budget
    raise AssertionError(f"no budget on the ladder works for {name} with {policy}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["gpt2", "bert", "cnn", "bilstm"])
def test_trains_like_plain_at_smallest_budget(name: str, policy: str, backend: str) -> None:
    expected, free = reference(name, backend)
    budget = smallest_budget(name, policy, backend)
    assert budget < max(s.peak_bytes for s in free)
    _, model, batch = copies(name)
    steps = Steps(budget=budget, policy=policy, backend=backend, thrash_limit=float("inf"))
    assert_same(expected, train(model, batch, steps))
    assert sum(s.evictions for s in steps.stats) > 0
    assert sum(s.recomputations for s in steps.stats) > 0
    for stats in steps.stats:
        assert stats.peak_bytes <= budget
        assert stats.peak_real_bytes <= budget
        assert stats.backend == backend


# test_evicts_what_the_simulator_evicts: a measured run that recomputes more than this stops and
# is drawn again, up to ATTEMPTS times. At 0.8 of the plain peak about 1 draw in 25 thrashes on an
# idle machine (at 0.7, 1 in 6, and more under load), and every draw still evicts (29 to 618 times).
THRASH_LIMIT = 4.0
ATTEMPTS = 5
BUDGET = 0.8


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["gpt2", "cnn"])
def test_evicts_what_the_simulator_evicts(name: str, policy: str) -> None:
    """Measured op costs: the trace records the costs the core saw, so the simulator replaying it
    must take every decision the runtime took."""
    _, free = reference(name)
    budget = int(BUDGET * max(s.peak_bytes for s in free))
    runs: list[DynamicStats] = []

    @contextlib.contextmanager
    def region(model: nn.Module, opt: torch.optim.Optimizer) -> Iterator[None]:
        dyn = remat.dynamic(budget, policy, keep=(model, opt), thrash_limit=THRASH_LIMIT)
        with dyn:
            yield
        runs.append(dyn.stats)

    for attempt in range(ATTEMPTS):
        _, model, batch = copies(name)
        runs = []
        try:
            train(model, batch, region, steps=2)
            break
        except remat.RematValueError as err:
            # Measured costs move with the machine's load: on a rare draw the policy's choices
            # cascade into chains of restores. The parity checked here holds for any draw that
            # completes, so such a run is stopped and drawn again.
            if "thrash" not in str(err) or attempt == ATTEMPTS - 1:
                raise
    assert sum(s.evictions for s in runs) > 0
    for stats in runs:
        comparison = stats.compare()
        assert comparison.same_evictions, (comparison.simulated_evictions, comparison.evictions)
        simulated = simulate(stats.trace, budget, policy, float("inf"))
        assert simulated.outcome is Outcome.OK
        assert (simulated.evictions, simulated.recomputations) == (stats.evictions, stats.recomputations)
        assert simulated.peak_bytes == stats.peak_bytes


def test_unlimited_budget_evicts_nothing_and_counts_the_peak() -> None:
    _, free = reference("cnn")
    for stats in free:
        assert stats.evictions == stats.recomputations == 0
        assert stats.needed_bytes < stats.peak_bytes
        assert stats.trace.peak_bytes <= stats.peak_bytes
        assert str(stats).startswith("dtr (accounting)")
