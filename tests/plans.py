"""Plans of the test models for the tests that run them (planner and fused replay): each model's
step traced once with fixed op costs, a plan per solver, and the allocator's peak of a step."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
from models import build, loss_of
from torch import nn

import remat
from remat import Plan, RematValueError
from remat.planner import BudgetTooSmall, plan_trace, trace_step
from remat.planner.api import plan_at
from remat.planner.frontier import Frontier
from remat.trace.types import Op, Trace

MILP = {"time_limit": 10.0, "max_nodes": 12}


def fixed_costs(trace: Trace) -> Trace:
    """``trace`` with each op's cost its cost model's estimate instead of its measured time, so that
    the plans (and what a test checks of them, such as which solver's plan wins) are the same from
    run to run rather than depend on how busy the machine was while it was traced."""
    events = tuple(dataclasses.replace(e, cost=e.est_cost) if isinstance(e, Op) else e for e in trace.events)
    return dataclasses.replace(trace, events=events)


def trace_with_fixed_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``remat.plan`` and ``remat plan`` plan on fixed op costs (``fixed_costs``)."""
    import remat.planner.api as api

    measured = api.trace_step
    monkeypatch.setattr(api, "trace_step", lambda *args, **kwargs: fixed_costs(measured(*args, **kwargs)))


@functools.cache
def _traced(name: str) -> tuple[Trace, int, int]:
    """The step of model ``name`` traced once, its plain peak and the smallest peak of a plan."""
    model, batch, _ = build(name)
    trace = fixed_costs(trace_step(model, batch(0), repeats=1))
    base = plan_trace(trace, 1.0).baseline_peak_bytes
    with pytest.raises(BudgetTooSmall) as info:
        plan_trace(trace, 1)
    match = re.search(r"the minimum is (\d+) bytes", str(info.value))
    assert match is not None and int(match.group(1)) == info.value.minimum_bytes
    return trace, base, info.value.minimum_bytes


@functools.cache  # a Plan is immutable; the MILP's candidates take seconds to find
def _plan(name: str, solver: str) -> Plan:
    trace, base, low = _traced(name)
    budget = (low + base) // 2
    options: dict[str, Any] = MILP if solver == "milp" else {}
    return plan_trace(trace, budget, solver=solver, **options)


def _measured_peak(model: nn.Module, inputs: dict[str, Any], plan: Plan | None, replay: str = "eager") -> int:
    model.zero_grad(set_to_none=True)
    with remat.memory.track(timeline=False, allocator=True) as tracked:
        if plan is None:
            loss = loss_of(model(**inputs))
        else:
            with plan.apply(model, replay):
                loss = loss_of(model(**inputs))
        loss.backward()
    return tracked.peak_bytes


def assert_monotone(found: Frontier, name: str, fractions: list[float]) -> None:
    """Budgets at ``fractions`` of the way from ``name``'s floor to its plain peak: once one is
    feasible every larger one is, and a larger one never gets a costlier plan from ``found``."""
    _, base, low = _traced(name)
    budgets = sorted(int(low + f * (base - low)) for f in fractions)
    overheads: list[float | None] = []
    for budget in budgets:
        try:
            overheads.append(plan_at(found, budget).predicted_overhead)
        except RematValueError:  # BudgetTooSmall, or no plan of this solver fits
            overheads.append(None)
    feasible = [o for o in overheads if o is not None]
    assert overheads[len(overheads) - len(feasible) :] == feasible
    assert all(a >= b for a, b in zip(feasible, feasible[1:], strict=False)), (budgets, overheads)


def step_peak(model: nn.Module, loss: Callable[[nn.Module], Any], plan: Plan | None = None) -> int:
    """The allocator's peak of one training step of ``model`` (``loss(model)``), under ``plan``."""
    model.zero_grad(set_to_none=True)
    with remat.memory.track(timeline=False, allocator=True) as tracked:
        with plan.apply(model) if plan is not None else contextlib.nullcontext():
            value = loss(model)
        value.backward()
    return tracked.peak_bytes


def floor_of(trace: Trace, **options: Any) -> int:
    """The smallest peak a plan of ``trace`` reaches: the figure ``BudgetTooSmall`` names."""
    with pytest.raises(BudgetTooSmall) as info:
        plan_trace(trace, 1, **options)
    return info.value.minimum_bytes
