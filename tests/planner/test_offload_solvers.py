"""The three-way solvers on hand-made chains: the MILP's plans are never worse than recomputation
alone (its space contains those plans), both solvers' copies run over several steps, an infinitely
fast link reaches budgets recomputation cannot at no cost, a slow one leaves offload out, the host
budget holds, and the offload model refuses schedules it cannot run; the MILP answers the greedy
rule's plan without HiGHS where it takes the plain step's time, of equally fast plans the one
moving least, and checks the host budget of HiGHS's answer."""

from __future__ import annotations

import dataclasses

import pytest

import remat
from remat import RematValueError
from remat.planner.offload_model import (
    Item,
    Move,
    OffloadProblem,
    OffloadSchedule,
    backward_step,
    evaluate,
)
from remat.planner.solvers import get, offload_milp
from remat.planner.solvers.offload_greedy import OffloadFailed
from remat.planner.types import Chain
from remat.policy import Decision

FAST = remat.Link(d2h=1e18, h2d=1e18, latency=0)
SLOW = remat.Link(d2h=10, h2d=10, latency=0)


def chain_problem(
    n: int, link: remat.Link, host_budget: int | None = None, internal: int = 300, output: int = 100
) -> OffloadProblem:
    """``n`` stages of forward 1 s and backward 2 s, each saving ``internal`` bytes (dropped when
    it is recomputed) and handing the next an ``output`` it saves as well."""
    chain = Chain.of([1.0] * n, [2.0] * n, [output] * n, [internal] * n, input_bytes=output)
    items = []
    for k in range(n):
        b = backward_step(n, k)
        items.append(Item(f"x{k}", 2 * k, internal, k, k, b, b, frozenset(), k < n - 1))
        if k < n - 1:
            ahead = backward_step(n, k + 1)
            items.append(Item(f"a{k + 1}", 2 * k + 1, output, k, k + 1, ahead, b, frozenset({k + 1})))
    return OffloadProblem(chain, tuple(items), link, host_budget)


def solve(name: str, problem: OffloadProblem, budget: int) -> remat.planner.Solution:
    options = {"time_limit": 20.0} if name == "offload_milp" else {}
    return get(name).solve(problem, budget, **options)


def recompute_only(problem: OffloadProblem) -> OffloadProblem:
    return dataclasses.replace(problem, host_budget=0)


@pytest.mark.parametrize("rate", [1e18, 400.0, 100.0, 10.0])
@pytest.mark.parametrize("budget", [2400, 1600, 1200])
def test_milp_is_never_worse_than_recomputation_alone(rate: float, budget: int) -> None:
    problem = chain_problem(6, remat.Link(d2h=rate, h2d=rate, latency=0))
    exact = solve("offload_milp", problem, budget)
    alone = solve("offload_milp", recompute_only(problem), budget)
    assert exact.predicted_peak_bytes <= budget and alone.predicted_peak_bytes <= budget
    assert exact.total_cost <= alone.total_cost + 1e-9
    assert not [d for d in alone.decisions if d.action is Decision.OFFLOAD]
    try:
        fast = solve("offload_greedy", problem, budget)
    except OffloadFailed:
        return
    assert fast.predicted_peak_bytes <= budget


def test_both_solvers_let_a_copy_run_over_several_steps() -> None:
    """A copy of an internal tensor takes 3 s each way, longer than any 1 s forward step: both
    solvers' copies run over the forward and hide, and the MILP's plan is no slower than the
    greedy rule's."""
    problem = chain_problem(6, remat.Link(d2h=100, h2d=100, latency=0))
    exact = solve("offload_milp", problem, 1600)
    fast = solve("offload_greedy", problem, 1600)
    for plan in (exact, fast):
        assert plan.predicted_peak_bytes <= 1600
        assert plan.cost is not None and plan.cost.stall == 0.0
        assert plan.offload.moves and all(plan.cost.gone_step(m.item) > m.out for m in plan.offload.moves)
    assert exact.total_cost <= fast.total_cost


def test_an_infinitely_fast_link_reaches_budgets_recomputation_cannot_at_no_cost() -> None:
    """Stage outputs (here the most of the bytes) stay on the device when only recomputing."""
    problem = chain_problem(8, FAST, internal=100, output=400)
    budget = 2400
    with pytest.raises(RematValueError, match="no three-way plan fits the budget"):
        solve("offload_milp", recompute_only(problem), budget)
    for name in ("offload_milp", "offload_greedy"):
        plan = solve(name, problem, budget)
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_overhead == 1.0
        assert any(d.action is Decision.OFFLOAD for d in plan.decisions)
        assert not any(d.action is Decision.RECOMPUTE for d in plan.decisions)


@pytest.mark.parametrize("name", ["offload_milp", "offload_greedy"])
def test_a_slow_link_leaves_offload_out(name: str) -> None:
    plan = solve(name, chain_problem(6, SLOW), 1600)
    assert plan.predicted_peak_bytes <= 1600
    assert {d.action for d in plan.decisions} == {Decision.SAVE, Decision.RECOMPUTE}


@pytest.mark.parametrize("name", ["offload_milp", "offload_greedy"])
@pytest.mark.parametrize("host", [300, 700])
def test_the_host_budget_holds(name: str, host: int) -> None:
    problem = chain_problem(6, FAST, host_budget=host)
    plan = solve(name, problem, 2000)
    assert plan.predicted_peak_bytes <= 2000
    moved = sum(problem.items[d.index].nbytes for d in plan.decisions if d.action is Decision.OFFLOAD)
    assert 0 < moved <= host


def test_the_stall_is_the_link_time_compute_does_not_hide() -> None:
    problem = chain_problem(3, remat.Link(d2h=100, h2d=50, latency=0.5))
    # x0 (300 bytes) must leave in the forward of stage 1 (1 s): 0.5 + 3 s on the link, 2.5 s of
    # stall; it comes back from the backward of stage 1 (2 s): 0.5 + 6 s, 4.5 s of stall
    cost = evaluate(problem, OffloadSchedule(moves=(Move(0, 1, 4, gone=1),)))
    assert cost.stall == pytest.approx(2.5 + 4.5)
    assert cost.total_cost == pytest.approx(problem.base_cost + 7.0)
    assert cost.host_bytes == 300
    plain = evaluate(problem, OffloadSchedule())
    # x0 is off the device in steps 2 and 3 only: the peak there drops by its bytes
    assert [a - b for a, b in zip(plain.memory, cost.memory, strict=True)] == [0, 0, 300, 300, 0, 0]


def test_a_copy_runs_over_as_many_steps_as_it_takes() -> None:
    """Six stages (forward 1 s, backward 2 s), 3 s per copy: x0's copy out, issued at 1 s, is done
    at the end of step 3, so x0 is off the device in steps 4 to 8; its copy back, issued at 12 s
    in step 9, is done at 15 s, before its backward starts at 16 s: no stall."""
    problem = chain_problem(6, remat.Link(d2h=100, h2d=100, latency=0))
    cost = evaluate(problem, OffloadSchedule(moves=(Move(0, 1, 9),)))
    plain = evaluate(problem, OffloadSchedule())
    assert cost.stall == 0.0 and cost.gone_step(0) == 3
    assert [a - b for a, b in zip(plain.memory, cost.memory, strict=True)] == [0] * 4 + [300] * 5 + [0] * 3
    # issued one step later it comes back at 17 s: a second of stall
    assert evaluate(problem, OffloadSchedule(moves=(Move(0, 1, 10),))).stall == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("schedule", "rule"),
    [
        (OffloadSchedule(moves=(Move(0, 0, 4),)), "goes out after the step that made it"),
        (OffloadSchedule(moves=(Move(0, 2, 5),)), "back before its need"),
        (OffloadSchedule(moves=(Move(0, 2, 4, gone=4),)), "before its copy back"),
        (OffloadSchedule(frozenset({0}), (Move(0, 1, 4),)), "stays on the device"),
        (OffloadSchedule(frozenset({2})), "a recomputed stage is a stage of the chain but the last"),
    ],
)
def test_the_model_refuses_schedules_it_cannot_run(schedule: OffloadSchedule, rule: str) -> None:
    with pytest.raises(RematValueError, match=rule):
        evaluate(chain_problem(3, FAST), schedule)


def test_the_solvers_refuse_other_problems() -> None:
    chain = Chain.of([1.0], [1.0], [1], [1])
    with pytest.raises(remat.RematTypeError, match="takes a OffloadProblem"):
        get("offload_milp").solve(chain, 10)


def test_the_milp_answers_the_greedy_rules_plan_at_once_where_it_takes_the_plain_steps_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No plan is faster than the plain step's compute, so HiGHS is not asked."""

    def never(*_: object) -> None:
        raise AssertionError("HiGHS was asked")

    monkeypatch.setattr(offload_milp._Program, "run", never)
    problem = chain_problem(8, FAST, internal=100, output=400)
    fast = get("offload_greedy").solve(problem, 2400)
    assert fast.total_cost == problem.base_cost
    plan = get("offload_milp").solve(problem, 2400)
    assert plan.offload == fast.offload and plan.gap == 0.0


def test_of_equally_fast_plans_the_milp_answers_the_one_moving_least(monkeypatch: pytest.MonkeyPatch) -> None:
    """HiGHS (within its gap) answering the greedy rule's plan with one more move that costs no
    time: the program's objective (time plus a trifle per move) prefers the greedy rule's."""
    problem = chain_problem(4, remat.Link(d2h=100, h2d=100, latency=0))
    fast = get("offload_greedy").solve(problem, 1400)
    assert fast.offload == OffloadSchedule(frozenset({1}))
    more = OffloadSchedule(fast.offload.recompute, (Move(0, 1, 4, 3),))
    assert evaluate(problem, more).total_cost == fast.total_cost > problem.base_cost
    assert evaluate(problem, more).peak_bytes <= 1400
    monkeypatch.setattr(offload_milp._Program, "run", lambda *_: (more, 0.0, 0))
    plan = get("offload_milp").solve(problem, 1400)
    assert plan.offload == fast.offload


def test_the_milp_checks_the_host_budget_of_what_highs_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """HiGHS (its tolerance) answering a faster plan 100 B over the host budget: cut off, and the
    greedy rule's plan answered."""
    problem = chain_problem(4, FAST, host_budget=300)
    over = OffloadSchedule(moves=(Move(0, 1, 6, 1), Move(1, 1, 5, 1)))
    cost = evaluate(problem, over)
    fast = get("offload_greedy").solve(problem, 1300)
    assert cost.peak_bytes <= 1300 and cost.host_bytes == 400 and cost.total_cost < fast.total_cost
    monkeypatch.setattr(offload_milp._Program, "run", lambda *_: (over, 0.0, 0))
    plan = get("offload_milp").solve(problem, 1300)
    assert plan.offload == fast.offload
