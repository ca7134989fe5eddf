"""remat.plan solvers: the exact ones equal brute force, the baselines never beat them, every plan fits.

Brute force is evaluated by the same cost model as the solvers (``remat.planner.cost_model``):
- chains: every persistent schedule (NOTE [chain DP]'s grammar, enumerated without memo or
  rounding), and every single-level save/recompute subset (``chain_segments``);
- dags: every Checkmate schedule (NOTE [DAG MILP]: each stage's computed and kept sets,
  searched stage by stage over the kept set), and every save/recompute subset (``dag_from_saved``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat import RematValueError
from remat.planner import (
    BackwardStep,
    Chain,
    ChainOp,
    ChainSchedule,
    ChainStep,
    Dag,
    DagStage,
    Node,
    solve,
    solvers,
)
from remat.planner.chain_recursion import minimum_peak
from remat.planner.cost_model import dag_stage, schedule_cost
from remat.planner.single_level import chain_segments, dag_from_saved
from remat.policy import Decision

EXAMPLES = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
BELOW = "budget below the smallest feasible peak"


# -- brute force --------------------------------------------------------------------------------


@cache
def persistent(s: int, t: int) -> tuple[tuple[ChainStep, ...], ...]:
    """Every persistent schedule of stages s..t."""
    out: list[tuple[ChainStep, ...]] = []
    for rest in persistent(s + 1, t) if s < t else ((),):
        out.append((ChainStep(ChainOp.F_ALL, s), *rest, ChainStep(ChainOp.BACKWARD, s)))
    for split in range(s + 1, t + 1):
        ahead = (
            ChainStep(ChainOp.F_CHECK, s),
            *(ChainStep(ChainOp.F_NOGRAD, j) for j in range(s + 1, split)),
        )
        out += [ahead + a + b for a in persistent(split, t) for b in persistent(s, split - 1)]
    return tuple(out)


def chain_subsets(chain: Chain) -> Iterator[ChainSchedule]:
    """Every single-level plan: each partition of the stages into segments, each segment recomputed
    or not (what ``chain_segments`` runs: checkpoint_sequential with any cuts)."""
    n = len(chain)
    for cuts in range(2 ** max(0, n - 1)):
        bounds = [0, *(k + 1 for k in range(n - 1) if cuts >> k & 1), n]
        parts = list(itertools.pairwise(bounds))
        for mask in range(2 ** len(parts)):
            yield chain_segments(chain, [p for j, p in enumerate(parts) if mask >> j & 1])


def best(problem: Chain | Dag, schedules: Iterator[ChainSchedule] | list, budget: float) -> float:
    """The least simulated cost among ``schedules`` whose peak fits ``budget`` (inf if none)."""
    costs = [
        cost.total_cost
        for cost in map(lambda s: schedule_cost(problem, s), schedules)
        if cost.peak_bytes <= budget
    ]
    return min(costs, default=math.inf)


def checkmate(dag: Dag) -> list[tuple[int, float]]:
    """Exhaustive search over Checkmate schedules: the (peak, cost) pairs no schedule beats on both.
    A stage's outcome depends only on what it starts with, so the search runs stage by stage over
    the kept set; it prunes only kept values that no later stage can use."""
    n = len(dag.nodes)
    ancestors: list[set[int]] = []
    for i, node in enumerate(dag.nodes):
        ancestors.append({i}.union(*(ancestors[d] for d in node.deps)))
    states: dict[frozenset[int], list[tuple[int, float]]] = {frozenset(): [(0, 0.0)]}
    for t in range(n + len(dag.backward)):
        useful = {i for i in range(n) if any(u > t for u in dag.users[i])}
        for step in dag.backward[max(0, t + 1 - n) :]:
            useful |= set().union(*(ancestors[r] for r in step.reads))
        pool = range(t) if t < n else range(n)
        after: dict[frozenset[int], list[tuple[int, float]]] = {}
        for live, front in states.items():
            optional = [i for i in pool if i not in live]
            for r in range(len(optional) + 1):
                for extra in itertools.combinations(optional, r):
                    compute = tuple(sorted(extra + ((t,) if t < n else ())))
                    have = set(live) | set(compute)
                    if any(not set(dag.nodes[k].deps) <= have for k in compute):
                        continue
                    spent = sum(dag.nodes[k].cost for k in compute)
                    keepable = sorted(have & useful)
                    held = sum(dag.nodes[i].bytes for i in live)
                    for q in range(len(keepable) + 1):
                        for keep in itertools.combinations(keepable, q):
                            stage = DagStage(compute, tuple(sorted(have - set(keep))))
                            try:
                                peak, _ = dag_stage(dag, t, live, held, stage)
                            except RematValueError:
                                continue
                            points = after.setdefault(frozenset(keep), [])
                            points += [(max(p, peak), c + spent) for p, c in front]
        states = {k: pareto(v) for k, v in after.items()}
    backward = sum(step.cost for step in dag.backward)
    return pareto([(p, c + backward) for front in states.values() for p, c in front])


def pareto(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    out: list[tuple[int, float]] = []
    for p, c in sorted(points):
        if not out or c < out[-1][1]:
            out.append((p, c))
    return out


def graph_subsets(dag: Dag) -> Iterator:
    for r in range(len(dag.saved) + 1):
        for kept in itertools.combinations(dag.saved, r):
            yield dag_from_saved(dag, kept)


# -- strategies ---------------------------------------------------------------------------------


@st.composite
def chains(draw: st.DrawFn, most: int = 5) -> Chain:
    n = draw(st.integers(1, most))
    small = st.integers(0, 6)
    return Chain.of(
        [draw(st.integers(0, 5)) for _ in range(n)],
        [draw(st.integers(0, 5)) for _ in range(n)],
        [draw(small) for _ in range(n)],
        [draw(small) for _ in range(n)],
        draw(st.integers(0, 4)),
    )


@st.composite
def dags(draw: st.DrawFn, nodes: int = 4, steps: int = 4) -> Dag:
    """Random DAGs: a node reads its predecessor more often than not and maybe earlier nodes;
    backward steps read one or two nodes, so that recomputing trades memory for compute."""
    n = draw(st.integers(2, nodes))
    made = []
    for i in range(n):
        deps = tuple(d for d in range(i) if draw(st.booleans()) or (d == i - 1 and draw(st.booleans())))
        made.append(Node(str(i), draw(st.integers(0, 4)), draw(st.integers(1, 8)), deps))
    backward = [
        BackwardStep(
            f"b{j}",
            tuple(sorted(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=2)))),
            draw(st.integers(0, 2)),
            draw(st.integers(0, 3)),
        )
        for j in range(draw(st.integers(1, steps)))
    ]
    return Dag(tuple(made), tuple(backward))


def nominal(problem: Chain | Dag) -> int:
    """Peak with nothing recomputed."""
    if isinstance(problem, Chain):
        return schedule_cost(problem, chain_segments(problem, [])).peak_bytes
    return schedule_cost(problem, dag_from_saved(problem, problem.saved)).peak_bytes


# -- chains -------------------------------------------------------------------------------------


@EXAMPLES
@given(chains(), st.floats(0, 1))
def test_chain_dp_equals_the_best_persistent_schedule(chain: Chain, where: float) -> None:
    minimum, _ = minimum_peak(chain)
    top = nominal(chain)
    budget = max(1, round(minimum + where * (top - minimum)))
    plan = solvers.get("chain").solve(chain, budget)
    every = persistent(0, len(chain) - 1)
    assert min(schedule_cost(chain, ChainSchedule(s)).peak_bytes for s in every) == minimum
    assert plan.gap == 0.0 and plan.predicted_peak_bytes <= budget
    assert plan.total_cost == pytest.approx(best(chain, [ChainSchedule(s) for s in every], budget))
    assert plan.total_cost <= best(chain, chain_subsets(chain), budget) + 1e-9
    assert plan.predicted_overhead == pytest.approx(
        plan.total_cost / chain.base_cost if chain.base_cost else 1.0
    )


@EXAMPLES
@given(chains(), st.floats(0, 1))
def test_single_level_chain_dp_equals_the_best_checkpoint_sequential_plan(chain: Chain, where: float) -> None:
    minimum, _ = minimum_peak(chain)
    budget = max(1, round(minimum + where * (nominal(chain) - minimum)))
    best_single = best(chain, chain_subsets(chain), budget)
    if math.isinf(best_single):
        with pytest.raises(RematValueError, match="no single-level plan fits the budget"):
            solvers.get("chain").solve(chain, budget, single_level=True)
        return
    plan = solvers.get("chain").solve(chain, budget, single_level=True)
    assert plan.predicted_peak_bytes <= budget and plan.total_cost == pytest.approx(best_single)
    assert max(schedule_cost(chain, plan.schedule).runs) <= 2


@EXAMPLES
@given(chains(), st.floats(0, 1))
def test_baselines_never_beat_the_chain_dp_and_every_plan_fits(chain: Chain, where: float) -> None:
    minimum, _ = minimum_peak(chain)
    budget = max(1, round(minimum + where * (nominal(chain) - minimum)))
    exact = solvers.get("chain").solve(chain, budget).total_cost
    for name in ("sqrt", "greedy", "auto"):
        try:
            plan = solvers.get(name).solve(chain, budget)
        except RematValueError as error:
            assert name != "auto" and ("does not fit" in str(error) or "no plan" in str(error))
            continue
        assert plan.predicted_peak_bytes <= budget
        assert plan.total_cost >= exact - 1e-9


@EXAMPLES
@given(chains())
def test_a_budget_below_the_chain_minimum_is_refused_with_the_figure(chain: Chain) -> None:
    minimum, _ = minimum_peak(chain)
    if minimum <= 1:
        return
    for name in ("chain", "sqrt", "greedy", "auto"):
        with pytest.raises(
            RematValueError, match=rf"remat.plan: {BELOW} .*; the minimum is {minimum} bytes \(needed by"
        ):
            solvers.get(name).solve(chain, minimum - 1)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(chains(), st.integers(2, 30), st.integers(100, 997), st.floats(0, 1))
def test_the_chain_gap_bounds_the_loss_to_rounding(
    chain: Chain, slots: int, scale: int, where: float
) -> None:
    stages = [
        dataclasses.replace(s, output_bytes=s.output_bytes * scale, saved_bytes=s.saved_bytes * scale + 1)
        for s in chain.stages
    ]
    chain = Chain(tuple(stages), chain.input_bytes * scale)
    minimum, _ = minimum_peak(chain)
    budget = max(1, round(minimum + where * (nominal(chain) - minimum)))
    exact = solvers.get("chain").solve(chain, budget, slots=budget)
    plan = solvers.get("chain").solve(chain, budget, slots=slots)
    assert exact.gap == 0.0 and plan.predicted_peak_bytes <= budget
    assert plan.total_cost >= exact.total_cost - 1e-9
    if plan.gap is not None:
        assert plan.total_cost * (1 - plan.gap) <= exact.total_cost + 1e-9


def test_a_coarse_discretization_still_fits_and_bounds_its_gap() -> None:
    chain = Chain.of(
        [1, 3, 2, 5, 1], [2, 6, 4, 9, 2], [1000, 3000, 1000, 2000, 10], [4000, 1000, 3000, 2000, 10]
    )
    budget = 12_000
    fine = solvers.get("chain").solve(chain, budget, slots=budget)
    assert fine.gap == 0.0 and "units of 1 bytes" in fine.notes
    for slots in (5, 7, 50):
        coarse = solvers.get("chain").solve(chain, budget, slots=slots)
        assert coarse.predicted_peak_bytes <= budget and coarse.total_cost >= fine.total_cost - 1e-9
        assert coarse.gap is not None and coarse.total_cost * (1 - coarse.gap) <= fine.total_cost + 1e-9
        assert f"units of {-(-budget // slots)} bytes" in coarse.notes


def test_a_discretization_too_coarse_for_any_plan_falls_back_to_the_minimum_memory_schedule() -> None:
    chain = Chain.of([1, 1, 1], [1, 1, 1], [3, 1, 5], [6, 6, 1])
    minimum, schedule = minimum_peak(chain)
    plan = solvers.get("chain").solve(chain, minimum, slots=3)
    assert plan.schedule == schedule and plan.gap is None and "minimum-memory schedule" in plan.notes


def test_a_chain_plan_tells_the_executor_what_to_do_per_stage() -> None:
    chain = Chain.of([1, 1, 1, 1], [2, 2, 2, 2], [10, 10, 10, 1], [30, 30, 30, 3], input_bytes=10)
    plan = solve(chain, 100, solver="chain")
    assert plan.solver == "chain" and len(plan.decisions) == 4
    assert {plan.action(k) for k in range(4)} <= set(Decision)
    assert plan.recomputed == tuple(d.index for d in plan.decisions if d.action is Decision.RECOMPUTE)
    assert plan.recomputed, "100 bytes is below the 174-byte nominal peak: something is recomputed"
    assert ChainSchedule.parse(str(plan.schedule)) == plan.schedule
    assert "F_ck 0" in str(plan.schedule) and "schedule:" in str(plan)
    with pytest.raises(
        RematValueError, match=r"remat.plan: no decision for this index \(got 9\); ask about one of"
    ):
        plan.action(9)


def test_chain_schedules_print_as_runs_and_parse_back() -> None:
    for steps in persistent(0, 4):
        schedule = ChainSchedule(steps)
        assert ChainSchedule.parse(str(schedule)) == schedule
    assert str(ChainSchedule.parse("F_all 0-3, B 3-0")) == "F_all 0-3, B 3-0"
    with pytest.raises(RematValueError, match="a chain schedule is runs"):
        ChainSchedule.parse("F_all zero")


# -- dags -------------------------------------------------------------------------------------


@EXAMPLES
@given(dags(), st.integers(0, 99))
def test_milp_equals_the_best_checkmate_schedule(dag: Dag, pick: int) -> None:
    front = checkmate(dag)  # budgets right at a frontier peak: the hardest to meet exactly
    least, (budget, exact) = front[0][0], front[pick % len(front)]
    plan = solvers.get("milp").solve(dag, budget, mip_rel_gap=0.0)
    assert plan.predicted_peak_bytes <= budget
    assert plan.total_cost == pytest.approx(exact)
    if least > 1:
        with pytest.raises(RematValueError, match=rf"{BELOW} .*; the minimum is {least} bytes \(needed by"):
            solvers.get("milp").solve(dag, least - 1)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(dags(nodes=7, steps=4), st.floats(0, 1))
def test_baselines_never_beat_the_milp_on_dags_of_up_to_7_nodes(dag: Dag, where: float) -> None:
    subsets = list(graph_subsets(dag))
    least = min(schedule_cost(dag, s).peak_bytes for s in subsets)
    budget = max(1, round(least + where * (nominal(dag) - least)))
    exact = solvers.get("milp").solve(dag, budget, mip_rel_gap=0.0)
    assert exact.predicted_peak_bytes <= budget
    assert exact.total_cost <= best(dag, iter(subsets), budget) + 1e-9
    for name in ("sqrt", "greedy", "auto"):
        try:
            plan = solvers.get(name).solve(dag, budget)
        except RematValueError as error:
            assert "does not fit" in str(error) or "no plan" in str(error) or BELOW in str(error)
            continue
        assert plan.predicted_peak_bytes <= budget
        assert plan.total_cost >= exact.total_cost - 1e-6 * max(1.0, exact.total_cost)


def test_a_graph_below_the_lower_bound_names_the_op() -> None:
    dag = Dag((Node("a", 1, 10), Node("b", 1, 20, (0,))), (BackwardStep("gb", (1,), 1, 5),))
    for name in ("greedy", "sqrt"):
        with pytest.raises(
            RematValueError, match=rf"{BELOW} .*at least 30 bytes \(needed by forward 1 \(b\)\)"
        ):
            solvers.get(name).solve(dag, 29)


def test_milp_coarsens_a_large_graph_and_still_fits() -> None:
    nodes: list[Node] = []
    backward: list[BackwardStep] = []
    for block in range(12):
        for op in range(5):
            i = len(nodes)
            nodes.append(Node(f"op{op}", 1.0 + op, 10, (i - 1,) if i else (), (i,), f"h.{block}.op{op}"))
    for i in reversed(range(len(nodes))):
        backward.append(BackwardStep(f"g{i}", (i,), 2.0, 5, (100 + i,)))
    dag = Dag(tuple(nodes), tuple(backward))
    budget = nominal(dag) // 2
    plan = solvers.get("milp").solve(dag, budget, max_nodes=12, time_limit=20)
    assert plan.predicted_peak_bytes <= budget and "coarsened from 60 to 12 nodes" in plan.notes
    assert len(plan.decisions) == 12 and all(len(d.ops) == 5 for d in plan.decisions)
    auto = solvers.get("auto").solve(dag, budget)
    assert auto.solver == "greedy" and "auto picked greedy for a DAG of 60 > 20 nodes" in auto.notes
    assert auto.predicted_peak_bytes <= budget  # its cost may beat the coarse MILP's: blocks lose options


def test_auto_falls_back_to_the_milp_when_greedy_cannot_fit() -> None:
    dag = Dag(
        tuple(Node(str(i), 1.0, 10, (i - 1,) if i else ()) for i in range(6)),
        tuple(BackwardStep(f"g{i}", (i,), 1.0) for i in reversed(range(6))),
    )
    with pytest.raises(RematValueError, match="greedy found no plan within the budget"):
        solvers.get("greedy").solve(dag, 20)
    plan = solvers.get("auto").solve(dag, 20, max_milp_nodes=3)
    assert plan.solver == "milp" and "greedy found no plan" in plan.notes and plan.predicted_peak_bytes == 20
