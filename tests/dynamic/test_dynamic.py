"""remat.dynamic trains exactly like the plain model, within its budget as the allocator counts it,
deciding as the simulator.

Each workload trains two SGD steps (momentum, so the optimizer has state) with the whole step,
optimizer included, inside a region. Budgets come from the simulator: the region's own trace at no
budget is run on a ladder of budgets, as the backend lays memory out (NOTE [model addresses] in
``remat.core.runtime``: the accounting backend packs its model pool where only its addresses stand
in the way, the arena's addresses are the memory) and under the runs' thrash limit; those under
which every step runs are feasible. Where none is, the region must refuse the step with the
house's error, as the simulator ran out of memory. Costs come from the cost model
(``cost="model"``) so that the decisions, and hence the budgets that work, do not depend on timing
noise.

The budget is checked against the CPU allocator's own count (``remat.memory.track(allocator=True)``,
the profiler's allocation events) around each step's region, plus the bytes of the tensors from
before the region that the budget also counts (parameters, optimizer state): never against the
pool's count alone.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from dynamic_models import WORKLOADS, Result, assert_same, copies, train
from torch import nn

import remat
from remat import RematValueError
from remat.dynamic import Dynamic, DynamicStats, backends, homes
from remat.sim.result import Outcome
from remat.sim.simulate import simulate

POLICIES = ["dtr", "dte", "coop"]
BACKENDS = backends.names()
LADDER = (0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
RATIOS = (0.9, 0.7, 0.5)  # checked where feasible, and the smallest feasible one
STEPS = 2
THRASH = 50.0  # the runs' thrash limit, and the simulator's when it finds the budgets that work
# where the simulator finds no budget on the ladder: Coop's op-guided placement on the small CNN's
# arena, whose steps find no contiguous room (the convolutions' scratch, and after the first
# update the parameters' new versions, split the pool) on this machine's kernels
NO_ROOM = {("cnn", "coop", "arena")}
ARENA_RESERVE = {"": 0.3, "bilstm": 0.6}  # what lives beside the arena (see ``options``)


class Steps:
    """A region factory for ``train``: one region per step, registering the model and the
    optimizer first; keeps each step's stats and the allocator's peak around its region."""

    def __init__(self, measure: bool = True, **options: Any) -> None:
        self.measure = measure
        self.options = options
        self.stats: list[DynamicStats] = []
        self.allocator: list[int] = []

    @contextlib.contextmanager
    def __call__(self, model: nn.Module, opt: torch.optim.Optimizer) -> Iterator[Dynamic]:
        region = remat.dynamic(keep=(model, opt), cost="model", **self.options)
        if not self.measure:  # the profiler stays free: the region learns its ops' scratch
            with region:
                yield region
            self.stats.append(region.stats)
            return
        with remat.memory.track(allocator=True) as measured, region:
            yield region
        self.stats.append(region.stats)
        self.allocator.append(measured.peak_bytes)


def options(name: str, backend: str) -> dict[str, Any]:
    """The pool gets what the simulator got: no reserve, except the arena's (what it copies out,
    and results of ops with no out= kernel, such as the oneDNN LSTM's, while they are copied in)."""
    reserve = ARENA_RESERVE.get(name, ARENA_RESERVE[""]) if backend == "arena" else 0
    return {"backend": backend, "reserve": reserve}


def budget_of(capacity: int, name: str, backend: str) -> int:
    """The budget whose pool holds ``capacity`` bytes with ``options(name, backend)``'s reserve."""
    reserve = options(name, backend)["reserve"]
    budget = int(capacity / (1.0 - reserve))
    while budget - int(reserve * budget) < capacity:
        budget += 1
    return budget


@functools.cache
def reference(name: str) -> tuple[Result, tuple[DynamicStats, ...]]:
    """The plain run, and the stats of the same run in a region with no budget (which also learns
    every op's scratch bytes, so that the budgeted runs count them)."""
    plain, copy, batch = copies(name)
    result = train(plain, batch, None, STEPS)
    free = Steps(measure=False, budget=None, policy="dtr")
    assert_same(result, train(copy, batch, free, STEPS))
    return result, tuple(free.stats)


def simulated(name: str, policy: str, backend: str, ratio: float) -> list[Outcome]:
    """Each step of ``name`` in the simulator at ``ratio`` of the plain peak, as ``backend`` lays
    memory out (its own ``compact``, NOTE [model addresses]) and under the runs' thrash limit."""
    _, steps = reference(name)
    peak = max(s.peak_bytes for s in steps)
    compact = not backends.get(backend).places
    return [simulate(s.trace, int(ratio * peak), policy, THRASH, compact=compact).outcome for s in steps]


@functools.cache
def feasible(name: str, policy: str, backend: str) -> tuple[float, ...]:
    """The ratios of the ladder under which the simulator runs every step of ``name``."""
    return tuple(r for r in LADDER if all(o is Outcome.OK for o in simulated(name, policy, backend, r)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_trains_like_plain_within_the_allocators_budget(name: str, policy: str, backend: str) -> None:
    expected, free = reference(name)
    peak = max(s.peak_bytes for s in free)
    ratios = feasible(name, policy, backend)
    if not ratios:
        _the_step_is_refused_where_the_simulator_runs_out(name, policy, backend, peak)
        return
    checked = sorted({r for r in RATIOS if r in ratios} | {min(ratios)}, reverse=True)
    evictions = 0
    for ratio in checked:
        capacity = int(ratio * peak) // homes.ALIGNMENT * homes.ALIGNMENT  # NOTE [alignment] in ``homes``
        budget = budget_of(capacity, name, backend)
        _, model, batch = copies(name)
        steps = Steps(budget=budget, policy=policy, thrash_limit=THRASH, **options(name, backend))
        assert_same(expected, train(model, batch, steps, STEPS))
        for stats, allocated in zip(steps.stats, steps.allocator, strict=True):
            assert stats.capacity == capacity and stats.backend == backend
            assert stats.peak_bytes <= capacity
            assert allocated + stats.outside_bytes <= budget, (ratio, allocated, stats.outside_bytes, budget)
            evictions += stats.evictions
    assert evictions > 0


def _the_step_is_refused_where_the_simulator_runs_out(
    name: str, policy: str, backend: str, peak: int
) -> None:
    """No ratio of the ladder runs: at its top the simulator runs out of memory, and the region
    refuses the step with the house's error and undoes it (the model's parameters and buffers and
    the optimizer's state as they were when the step began)."""
    assert (name, policy, backend) in NO_ROOM, (
        f"no budget on the ladder works for {name}, {policy}, {backend}"
    )
    ratio = LADDER[0]
    assert Outcome.OOM in simulated(name, policy, backend, ratio), simulated(name, policy, backend, ratio)
    capacity = int(ratio * peak) // homes.ALIGNMENT * homes.ALIGNMENT
    _, model, batch = copies(name)
    steps = Steps(
        budget=budget_of(capacity, name, backend),
        policy=policy,
        thrash_limit=THRASH,
        **options(name, backend),
    )
    at_entry: dict[str, Any] = {}

    def region(model: nn.Module, opt: torch.optim.Optimizer) -> contextlib.AbstractContextManager[Dynamic]:
        at_entry["model"] = copy.deepcopy(model.state_dict())
        at_entry["optimizer"] = copy.deepcopy(opt.state_dict())
        at_entry["opt"] = opt
        return steps(model, opt)

    with pytest.raises(
        RematValueError, match=r"remat\.dynamic: .* found no contiguous room.*the step was undone"
    ):
        train(model, batch, region, STEPS)
    for key, value in model.state_dict().items():
        assert torch.equal(value, at_entry["model"][key]), key
    state = at_entry["opt"].state_dict()["state"]
    assert state.keys() == at_entry["optimizer"]["state"].keys()
    for k, entry in state.items():
        for key, value in entry.items():
            assert torch.equal(value, at_entry["optimizer"]["state"][k][key]), (k, key)


# test_evicts_what_the_simulator_evicts: at 0.9 of the unconstrained peak every policy evicts
# (constants keep every version, NOTE [constants stay], so 0.8 left Coop's address pool of the CNN
# without contiguous room).
THRASH_LIMIT = 4.0
BUDGET = 0.9


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["gpt2", "cnn"])
def test_evicts_what_the_simulator_evicts(name: str, policy: str) -> None:
    """The trace records the costs the core saw and the stats the moments the program's gradients
    were marked wanted at the end, so the simulator running both must take every decision the
    runtime took. The costs are the cost model's (``cost="model"``): the same step
    makes the same decisions on every run, whatever the machine's load."""
    _, free = reference(name)
    budget = int(BUDGET * max(s.peak_bytes for s in free))
    runs: list[DynamicStats] = []

    @contextlib.contextmanager
    def region(model: nn.Module, opt: torch.optim.Optimizer) -> Iterator[None]:
        dyn = remat.dynamic(
            budget, policy, keep=(model, opt), thrash_limit=THRASH_LIMIT, cost="model", reserve=0
        )
        with dyn:
            yield
        runs.append(dyn.stats)

    _, model, batch = copies(name)
    train(model, batch, region, steps=2)
    assert sum(s.evictions for s in runs) > 0
    for stats in runs:
        assert stats.wants  # the parameters' gradients: NOTE [wanted at the end] in remat.core.residency
        comparison = stats.compare()  # the trace, with those marks made at the same moments
        assert comparison.same_evictions, (comparison.simulated_evictions, comparison.evictions)
        assert comparison.simulated_recomputations == stats.recomputations
        assert comparison.simulated_peak == stats.peak_bytes


def test_unlimited_budget_evicts_nothing_and_counts_the_peak() -> None:
    _, free = reference("cnn")
    for stats in free:
        assert stats.evictions == stats.recomputations == 0
        assert stats.needed_bytes < stats.peak_bytes
        assert stats.trace.peak_bytes <= stats.peak_bytes
        assert str(stats).startswith("dtr (accounting)")
