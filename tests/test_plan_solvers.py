"""remat.plan solvers: the exact ones equal brute force, the baselines never beat them, every plan fits.

Brute force runs through the same simulator as the solvers (``remat.planner.solvers.simulate``):
- chains: every persistent schedule (NOTE [chain DP]'s grammar, enumerated without memo or
  rounding), and every single-level save/recompute subset (``chain_segments``);
- graphs: every Checkmate schedule (NOTE [graph MILP]: each stage's computed and kept sets,
  searched stage by stage over the kept set), and every save/recompute subset (``graph_from_saved``).
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

from remat import RematTypeError, RematValueError
from remat.planner import (
    Action,
    BackwardStep,
    Chain,
    ChainOp,
    ChainSchedule,
    ChainStep,
    Graph,
    GraphStage,
    Node,
    Stage,
    chain_from_trace,
    coarsen,
    graph_from_trace,
    solve,
    solvers,
    stage_key,
)
from remat.planner.solvers.chain_dp import minimum_peak
from remat.planner.solvers.simulate import chain_segments, graph_from_saved, graph_stage, simulate
from remat.trace import Op, Phase, Release, TensorInfo, Trace

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


def best(problem: Chain | Graph, schedules: Iterator[ChainSchedule] | list, budget: float) -> float:
    """The least simulated cost among ``schedules`` whose peak fits ``budget`` (inf if none)."""
    costs = [
        sim.total_cost for sim in map(lambda s: simulate(problem, s), schedules) if sim.peak_bytes <= budget
    ]
    return min(costs, default=math.inf)


def checkmate(graph: Graph) -> list[tuple[int, float]]:
    """Exhaustive search over Checkmate schedules: the (peak, cost) pairs no schedule beats on both.
    A stage's outcome depends only on what it starts with, so the search runs stage by stage over
    the kept set; it prunes only kept values that no later stage can use."""
    n = len(graph.nodes)
    ancestors: list[set[int]] = []
    for i, node in enumerate(graph.nodes):
        ancestors.append({i}.union(*(ancestors[d] for d in node.deps)))
    states: dict[frozenset[int], list[tuple[int, float]]] = {frozenset(): [(0, 0.0)]}
    for t in range(n + len(graph.backward)):
        useful = {i for i in range(n) if any(u > t for u in graph.users[i])}
        for step in graph.backward[max(0, t + 1 - n) :]:
            useful |= set().union(*(ancestors[r] for r in step.reads))
        pool = range(t) if t < n else range(n)
        after: dict[frozenset[int], list[tuple[int, float]]] = {}
        for live, front in states.items():
            optional = [i for i in pool if i not in live]
            for r in range(len(optional) + 1):
                for extra in itertools.combinations(optional, r):
                    compute = tuple(sorted(extra + ((t,) if t < n else ())))
                    have = set(live) | set(compute)
                    if any(not set(graph.nodes[k].deps) <= have for k in compute):
                        continue
                    spent = sum(graph.nodes[k].cost for k in compute)
                    keepable = sorted(have & useful)
                    held = sum(graph.nodes[i].bytes for i in live)
                    for q in range(len(keepable) + 1):
                        for keep in itertools.combinations(keepable, q):
                            stage = GraphStage(compute, tuple(sorted(have - set(keep))))
                            try:
                                peak, _ = graph_stage(graph, t, live, held, stage)
                            except RematValueError:
                                continue
                            points = after.setdefault(frozenset(keep), [])
                            points += [(max(p, peak), c + spent) for p, c in front]
        states = {k: pareto(v) for k, v in after.items()}
    backward = sum(step.cost for step in graph.backward)
    return pareto([(p, c + backward) for front in states.values() for p, c in front])


def pareto(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    out: list[tuple[int, float]] = []
    for p, c in sorted(points):
        if not out or c < out[-1][1]:
            out.append((p, c))
    return out


def graph_subsets(graph: Graph) -> Iterator:
    for r in range(len(graph.saved) + 1):
        for kept in itertools.combinations(graph.saved, r):
            yield graph_from_saved(graph, kept)


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
def graphs(draw: st.DrawFn, nodes: int = 4, steps: int = 4) -> Graph:
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
    return Graph(tuple(made), tuple(backward))


def nominal(problem: Chain | Graph) -> int:
    """Peak with nothing recomputed."""
    if isinstance(problem, Chain):
        return simulate(problem, chain_segments(problem, [])).peak_bytes
    return simulate(problem, graph_from_saved(problem, problem.saved)).peak_bytes


# -- chains -------------------------------------------------------------------------------------


@EXAMPLES
@given(chains(), st.floats(0, 1))
def test_chain_dp_equals_the_best_persistent_schedule(chain: Chain, where: float) -> None:
    minimum, _ = minimum_peak(chain)
    top = nominal(chain)
    budget = max(1, round(minimum + where * (top - minimum)))
    plan = solvers.get("chain").solve(chain, budget)
    every = persistent(0, len(chain) - 1)
    assert min(simulate(chain, ChainSchedule(s)).peak_bytes for s in every) == minimum
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
    assert max(simulate(chain, plan.schedule).runs) <= 2


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
    assert {plan.action(k) for k in range(4)} <= set(Action)
    assert plan.recomputed == tuple(d.index for d in plan.decisions if d.action is Action.RECOMPUTE)
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


def test_the_simulator_refuses_impossible_chain_schedules() -> None:
    chain = Chain.of([1, 1], [1, 1], [1, 1], [1, 1])
    with pytest.raises(RematValueError, match="B k runs in order"):
        simulate(chain, ChainSchedule.parse("F_all 0-1, B 0"))
    with pytest.raises(RematValueError, match="needs its input alive"):
        simulate(chain, ChainSchedule.parse("F_n 1"))
    with pytest.raises(RematValueError, match="runs every backward step"):
        simulate(chain, ChainSchedule.parse("F_all 0-1, B 1"))


# -- graphs -------------------------------------------------------------------------------------


@EXAMPLES
@given(graphs(), st.integers(0, 99))
def test_milp_equals_the_best_checkmate_schedule(graph: Graph, pick: int) -> None:
    front = checkmate(graph)  # budgets right at a frontier peak: the hardest to meet exactly
    least, (budget, exact) = front[0][0], front[pick % len(front)]
    plan = solvers.get("milp").solve(graph, budget, mip_rel_gap=0.0)
    assert plan.predicted_peak_bytes <= budget
    assert plan.total_cost == pytest.approx(exact)
    if least > 1:
        with pytest.raises(RematValueError, match=rf"{BELOW} .*; the minimum is {least} bytes \(needed by"):
            solvers.get("milp").solve(graph, least - 1)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(nodes=7, steps=4), st.floats(0, 1))
def test_baselines_never_beat_the_milp_on_dags_of_up_to_7_nodes(graph: Graph, where: float) -> None:
    subsets = list(graph_subsets(graph))
    least = min(simulate(graph, s).peak_bytes for s in subsets)
    budget = max(1, round(least + where * (nominal(graph) - least)))
    exact = solvers.get("milp").solve(graph, budget, mip_rel_gap=0.0)
    assert exact.predicted_peak_bytes <= budget
    assert exact.total_cost <= best(graph, iter(subsets), budget) + 1e-9
    for name in ("sqrt", "greedy", "auto"):
        try:
            plan = solvers.get(name).solve(graph, budget)
        except RematValueError as error:
            assert "does not fit" in str(error) or "no plan" in str(error) or BELOW in str(error)
            continue
        assert plan.predicted_peak_bytes <= budget
        assert plan.total_cost >= exact.total_cost - 1e-6 * max(1.0, exact.total_cost)


def test_a_graph_below_the_lower_bound_names_the_op() -> None:
    graph = Graph((Node("a", 1, 10), Node("b", 1, 20, (0,))), (BackwardStep("gb", (1,), 1, 5),))
    for name in ("greedy", "sqrt"):
        with pytest.raises(
            RematValueError, match=rf"{BELOW} .*at least 30 bytes \(needed by forward 1 \(b\)\)"
        ):
            solvers.get(name).solve(graph, 29)


def test_milp_coarsens_a_large_graph_and_still_fits() -> None:
    nodes: list[Node] = []
    backward: list[BackwardStep] = []
    for block in range(12):
        for op in range(5):
            i = len(nodes)
            nodes.append(Node(f"op{op}", 1.0 + op, 10, (i - 1,) if i else (), (i,), f"h.{block}.op{op}"))
    for i in reversed(range(len(nodes))):
        backward.append(BackwardStep(f"g{i}", (i,), 2.0, 5, (100 + i,)))
    graph = Graph(tuple(nodes), tuple(backward))
    budget = nominal(graph) // 2
    plan = solvers.get("milp").solve(graph, budget, max_nodes=12, time_limit=20)
    assert plan.predicted_peak_bytes <= budget and "coarsened from 60 to 12 nodes" in plan.notes
    assert len(plan.decisions) == 12 and all(len(d.ops) == 5 for d in plan.decisions)
    auto = solvers.get("auto").solve(graph, budget)
    assert auto.solver == "greedy" and "auto picked greedy for a graph of 60 > 20 nodes" in auto.notes
    assert auto.predicted_peak_bytes <= budget  # its cost may beat the coarse MILP's: blocks lose options


def test_auto_falls_back_to_the_milp_when_greedy_cannot_fit() -> None:
    graph = Graph(
        tuple(Node(str(i), 1.0, 10, (i - 1,) if i else ()) for i in range(6)),
        tuple(BackwardStep(f"g{i}", (i,), 1.0) for i in reversed(range(6))),
    )
    with pytest.raises(RematValueError, match="greedy found no plan within the budget"):
        solvers.get("greedy").solve(graph, 20)
    plan = solvers.get("auto").solve(graph, 20, max_milp_nodes=3)
    assert plan.solver == "milp" and "greedy found no plan" in plan.notes and plan.predicted_peak_bytes == 20


def test_graph_schedules_from_saved_sets_recompute_just_in_time() -> None:
    graph = Graph(
        (Node("a", 1, 4), Node("b", 2, 8, (0,)), Node("c", 3, 2, (1,))),
        (BackwardStep("gc", (2,), 1, 1), BackwardStep("gb", (1,), 1, 1), BackwardStep("ga", (0,), 1, 1)),
    )
    everything = simulate(graph, graph_from_saved(graph, (0, 1, 2)))
    only_a = graph_from_saved(graph, (0,))
    sim = simulate(graph, only_a)
    assert everything.runs == (1, 1, 1) and sim.runs == (1, 2, 2)
    assert sim.total_cost == everything.total_cost + 2 + 3
    assert only_a.stages[3:] == (GraphStage((1, 2), (2,)), GraphStage((), (1,)), GraphStage((), (0,)))
    assert str(only_a).endswith("1 2 | drop 2; - | drop 1; - | drop 0")


# -- registry -----------------------------------------------------------------------------------


def test_the_registry_lists_the_solvers_and_refuses_unknown_names() -> None:
    assert {"auto", "chain", "greedy", "milp", "sqrt"} <= set(solvers.names())
    assert solvers.get("chain").problems == (Chain,)
    with pytest.raises(
        RematValueError, match=r"remat.plan: unknown solver \(got 'rotor'\); use one of auto, chain"
    ):
        solvers.get("rotor")


def test_the_registry_checks_problem_type_options_and_budget() -> None:
    chain = Chain.of([1], [1], [1], [1])
    graph = Graph((Node("a", 1, 1),), (BackwardStep("g", (0,)),))
    with pytest.raises(
        RematTypeError, match=r"solver 'chain' takes a Chain \(got Graph\); use auto, greedy, milp, sqrt"
    ):
        solvers.get("chain").solve(graph, 10)
    with pytest.raises(RematTypeError, match=r"unknown option for solver 'chain' \(got slot\); use slots"):
        solvers.get("chain").solve(chain, 10, slot=3)
    with pytest.raises(RematTypeError, match="a byte count is required"):
        solvers.get("chain").solve(chain, 0.5)  # type: ignore[arg-type]
    assert solvers.get("chain").solve(chain, "1KB").budget_bytes == 1000


def test_problems_refuse_bad_shapes() -> None:
    with pytest.raises(RematValueError, match="a chain needs at least one stage"):
        Chain(())
    with pytest.raises(RematValueError, match="byte counts must be non-negative"):
        Chain((Stage("s", 1, 1, -1, 0),))
    with pytest.raises(RematValueError, match="deps must be earlier nodes"):
        Graph((Node("a", 1, 1, (0,)),), ())
    with pytest.raises(RematValueError, match="a backward step reads forward nodes"):
        Graph((Node("a", 1, 1),), (BackwardStep("g", (3,)),))


# -- problems from a trace ----------------------------------------------------------------------


def mlp_trace() -> Trace:
    """x -> [mm, gelu] (module 0) -> [mm, relu] (module 1) -> [mm, sum] (module 2), then backward."""
    f, b = Phase.FORWARD, Phase.BACKWARD
    sizes = {4: 40, 5: 40, 6: 40, 7: 40, 8: 8, 9: 4, 10: 4, 11: 40, 12: 40, 13: 40, 14: 40, 15: 16}
    tensors = [TensorInfo(i, 16 if i < 4 else sizes[i], constant=i < 4) for i in range(16)]
    events: list[Op | Release] = [
        Op(0, "aten.mm.default", (0, 1), (4,), cost=1.0, phase=f, module="0.lin"),
        Op(1, "aten.gelu.default", (4,), (5,), cost=1.0, phase=f, module="0.act"),
        Op(2, "aten.mm.default", (5, 2), (6,), cost=1.0, phase=f, module="1.lin"),
        Op(3, "aten.relu.default", (6,), (7,), cost=1.0, phase=f, module="1.act"),
        Release(6),
        Op(4, "aten.mm.default", (7, 3), (8,), cost=1.0, phase=f, module="2"),
        Op(5, "aten.sum.default", (8,), (9,), cost=1.0, phase=f, module="2"),
        Release(8),
        Op(6, "aten.ones_like.default", (9,), (10,), cost=2.0, phase=b, module="2"),
        Op(7, "aten.mm.default", (10, 3), (11,), cost=2.0, phase=b, module="2"),
        Release(10),
        Op(8, "aten.threshold_backward.default", (11, 7), (12,), cost=2.0, phase=b, module="1.act"),
        Release(11),
        Op(9, "aten.mm.default", (12, 5), (13,), cost=2.0, phase=b, module="1.lin"),
        Release(12),
        Op(10, "aten.gelu_backward.default", (13, 4), (14,), cost=2.0, phase=b, module="0.act"),
        Release(13),
        Op(11, "aten.mm.default", (14, 0), (15,), cost=2.0, phase=b, module="0.lin"),
        Release(14),
    ]
    return Trace(tuple(tensors), tuple(events), frozenset({4, 5, 7}), name="mlp")


def test_stage_keys_stop_at_the_first_list_index() -> None:
    assert stage_key("transformer.h.3.attn.c_attn") == "transformer.h.3"
    assert stage_key("layer1.0.conv1") == "layer1.0"
    assert stage_key("2") == "2" and stage_key("encoder.norm") == "encoder" and stage_key("") == ""
    assert stage_key("transformer.h.3.attn", depth=2) == "transformer.h"


def test_a_chain_from_a_trace_groups_ops_by_block() -> None:
    chain = chain_from_trace(mlp_trace())
    assert [s.name for s in chain.stages] == ["0", "1", "2"]
    assert [s.ops for s in chain.stages] == [(0, 1), (2, 3), (4, 5)]
    assert [s.output_bytes for s in chain.stages] == [40, 40, 4]  # gelu out, relu out, the loss
    assert [s.saved_bytes for s in chain.stages] == [40, 0, 0]  # gelu's input stays inside block 0
    assert [s.forward_cost for s in chain.stages] == [2.0, 2.0, 2.0]
    assert [s.backward_cost for s in chain.stages] == [4.0, 4.0, 4.0]
    assert chain.input_bytes == 0 and chain.name == "mlp"
    assert solve(chain, nominal(chain)).predicted_overhead == 1.0


def test_a_graph_from_a_trace_has_one_node_per_forward_op_and_coarsens_by_module() -> None:
    graph = graph_from_trace(mlp_trace())
    assert [n.bytes for n in graph.nodes] == [40, 40, 40, 40, 8, 4]
    assert [n.deps for n in graph.nodes] == [(), (0,), (1,), (2,), (3,), (4,)]
    assert [s.reads for s in graph.backward] == [(5,), (3,), (1,), (0,)]
    assert [s.ops for s in graph.backward] == [(6, 7), (8,), (9,), (10, 11)]
    assert graph.saved == (0, 1, 3, 5)
    assert graph.backward[0].live_bytes == 44  # the seed and the gradient of the relu output
    blocks = coarsen(graph, 3)
    assert [n.module for n in blocks.nodes] == ["0", "1", "2"]
    assert [n.bytes for n in blocks.nodes] == [80, 40, 4]  # block 1's relu input is internal
    assert [n.deps for n in blocks.nodes] == [(), (0,), (1,)]
    assert [s.reads for s in blocks.backward] == [(2,), (1,), (0,)]
    assert graph_from_trace(mlp_trace(), max_nodes=3) == blocks
    plan = solvers.get("milp").solve(blocks, nominal(blocks))
    assert plan.predicted_overhead == 1.0 and plan.decisions[0].ops == (0, 1)


def test_each_output_of_a_multi_output_op_is_a_node_of_its_own() -> None:
    """A batch norm's output dies with its reader; its saved statistics live until backward."""
    f, b = Phase.FORWARD, Phase.BACKWARD
    tensors = [TensorInfo(0, 8, constant=True), TensorInfo(1, 40), TensorInfo(2, 4), TensorInfo(3, 40)]
    events: list[Op | Release] = [
        Op(0, "aten.native_batch_norm.default", (0,), (1, 2), cost=3.0, phase=f, module="bn"),
        Op(1, "aten.relu.default", (1,), (3,), cost=1.0, phase=f, module="act"),
        Release(1),
        Op(2, "aten.threshold_backward.default", (3,), (), cost=1.0, phase=b, module="act"),
        Op(3, "aten.native_batch_norm_backward.default", (0, 2), (), cost=2.0, phase=b, module="bn"),
    ]
    graph = graph_from_trace(Trace(tuple(tensors), tuple(events)))
    assert [(n.name, n.cost, n.bytes, n.deps, n.ops) for n in graph.nodes] == [
        ("native_batch_norm@bn#0", 3.0, 40, (), (0,)),
        ("native_batch_norm@bn#1", 0.0, 4, (0,), (0,)),
        ("relu@act", 1.0, 40, (0,), (1,)),
    ]
    assert graph.saved == (1, 2)
    assert nominal(graph) == 84  # the output is freed after relu: 4 + 40 kept, not 84 + 40


def test_coarsening_one_module_of_many_ops_splits_it_evenly() -> None:
    graph = Graph(
        tuple(Node(str(i), 1.0, 1, (i - 1,) if i else ()) for i in range(10)),
        tuple(BackwardStep(f"g{i}", (i,)) for i in reversed(range(10))),
    )
    blocks = coarsen(graph, 4)
    assert [n.ops for n in blocks.nodes] == [(), (), (), ()]
    assert [n.cost for n in blocks.nodes] == [2.0, 3.0, 2.0, 3.0]
    assert [s.reads for s in blocks.backward] == [(3,), (2,), (1,), (0,)]
