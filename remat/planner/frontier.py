"""The plans a solver offers a step at every budget at once, so that a plan is monotone in its budget.

Why not solve at the budget asked for: a solver answers over a coarse model of the step (NOTE
[chain model], NOTE [DAG model]) and its plan is then checked on the step itself (``predict``);
a plan the model finds cheapest at one budget may predict worse than another plan it found at a
smaller one, and the rounding of the chain DP's units depends on the budget. So a user who gave
more memory could get a costlier plan. Here the candidates do not depend on the budget: each
solver is run down a ladder of its own budgets from the plain peak to the smallest it solves (the
next rung just below the last plan's peak, so the fast solvers list every plan their model ranks
best somewhere), and ``remat.plan`` returns the cheapest candidate that fits (NOTE [plan ties]).
A candidate that fits a budget fits every larger one, so the plan at a larger budget is never
costlier: NOTE [monotone plans].

Which ladders: ``chain`` and ``greedy`` on the chain of blocks and on a finer chain (each block
split into its direct submodules, so a plan can recompute a block's MLP and keep its attention:
the plans between "block recomputed" and "block kept" that spare budget buys); ``sqrt`` for every
segment count of either chain (fewer segments recompute less); ``milp`` on ``_MILP_RUNGS`` budgets
spread from its smallest to its plain peak (each solve takes seconds); ``auto`` the chain and
greedy ladders, plain checkpointing (``simple``), the plans near the smallest peak (``floor``),
each of those keeping matmul, convolution and attention outputs, and those keeping what fits under
their own peak, lowest first (``remat.planner.room``, NOTE [room under the peak]).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from remat._errors import RematValueError
from remat.host.link import Link
from remat.planner.bounds import lower_bound
from remat.planner.chain_recursion import minimum_peak
from remat.planner.cost_model import ExecutorCost
from remat.planner.executor_cost import measured
from remat.planner.lowering import chain_from_trace, dag_from_trace
from remat.planner.offload_model import OffloadProblem
from remat.planner.room import filled_all
from remat.planner.search import (
    Candidate,
    Step,
    chain_regions,
    floor,
    keeping_compute,
    predicted,
    regions_of,
    search,
    simple,
    untied,
)
from remat.planner.single_level import chain_segments, model_peak
from remat.planner.solvers import chain_dp, get
from remat.planner.solvers.registry import check_options
from remat.planner.solvers.sqrt import split
from remat.planner.types import Chain, Problem, Solution
from remat.trace.types import Trace

__all__ = ["Frontier", "finer_key", "frontier"]

# a ladder has about this many rungs at most: each below the last plan's peak and at least
# 1/_RUNGS of the span from the plain peak to the smallest below the previous rung, so that a chain
# with many blocks (whose plans are many) is still planned in a bounded time
_RUNGS = 24
# the chain DP's tables per ladder: each one at the lowest peak the one before found
_TABLES = 4
_MILP_RUNGS = 6
# a finer chain is solved by the chain DP only while it stays fast (cubic in the stages); the
# greedy ladder and sqrt's segment counts take it at any length (NOTE [finer chains])
_FINE_STAGES = 40


@dataclass(frozen=True)
class Frontier:
    """Every candidate plan of ``solver`` for a step (``candidates``, in the order they were made),
    the plain step's predicted peak (``baseline``), and the seconds it took to find them; with
    ``link``, offload's plans over it are among them (``remat.planner.offload_search``)."""

    solver: str
    step: Step
    chain: Chain
    baseline: int
    candidates: tuple[Candidate, ...]
    seconds: float
    link: Link | None = None
    host_budget: int | None = None


def finer_key(key: Callable[[str], str]) -> Callable[[str], str]:
    """The stage of a module path one level below its block: ``transformer.h.3.mlp.c_fc`` ->
    ``transformer.h.3.mlp`` where ``key`` gives ``transformer.h.3``."""

    def finer(path: str) -> str:
        block = key(path)
        if not block or not path.startswith(block + "."):
            return block
        return ".".join(path.split(".")[: block.count(".") + 2])

    return finer


def _distinct(step: Step, problem: Problem, solutions: list[Solution], seen: set[Any]) -> list[Candidate]:
    """The solutions as candidates, each set of regions predicted once (``seen`` holds those
    already made)."""
    out = []
    for solution in solutions:
        regions = regions_of(step, problem, solution)
        key = tuple((r.first, r.last, r.save) for r, _ in regions)
        if key not in seen:
            seen.add(key)
            out.append(
                Candidate(solution.solver, solution.gap, solution.notes, regions, predicted(step, regions))
            )
    return out


def pareto(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates no other beats in both peak and overhead (the only ones a budget can pick),
    in their order; of equal ones, the first."""
    ranked = sorted(range(len(candidates)), key=lambda k: (candidates[k].pred.peak_bytes, k))
    keep, least = set(), float("inf")
    for k in ranked:
        if candidates[k].pred.overhead < least:
            keep.add(k)
            least = candidates[k].pred.overhead
    return [c for k, c in enumerate(candidates) if k in keep]


def _thinned(solutions: list[Solution], top: int) -> list[Solution]:
    """At most about ``_RUNGS`` of the solutions, evenly spread over their model peaks from
    ``top`` down (each one predicted on the step costs as much as a solve), the lowest kept."""
    if not solutions:
        return []
    ordered = sorted(solutions, key=lambda s: -s.predicted_peak_bytes)
    stride = max(1, (top - ordered[-1].predicted_peak_bytes) // _RUNGS)
    out, last = [], top + stride
    for s in ordered[:-1]:
        if s.predicted_peak_bytes <= last - stride:
            out.append(s)
            last = s.predicted_peak_bytes
    return [*out, ordered[-1]]


def ladder(step: Step, solver: str, problem: Problem, options: dict[str, Any]) -> list[Candidate]:
    """``solver``'s plans from the plain peak of ``problem``'s model down to the smallest one it
    solves (NOTE [monotone plans]). The chain DP reads every rung off one table
    (``chain_dp.plans``), then solves again at the lowest peak it found, in finer units, until no
    lower plan appears."""
    top = model_peak(problem)
    solutions: list[Solution] = []
    if solver == "chain" and isinstance(problem, Chain):
        check_options(solver, chain_dp.plans, options)
        budget = top
        for _ in range(_TABLES):
            found = chain_dp.plans(problem, budget, **options)
            solutions += found
            lowest = min((s.predicted_peak_bytes for s in found), default=budget)
            if lowest >= budget:
                break
            budget = lowest
        return _distinct(step, problem, _thinned(solutions, top), set())
    chosen = get(solver)
    bottom = minimum_peak(problem)[0] if isinstance(problem, Chain) else lower_bound(problem)[0]
    stride = max(1, (top - bottom) // _RUNGS)
    target = top
    while target >= bottom:
        try:
            solution = chosen.solve(problem, target, **options)
        except RematValueError:
            break
        solutions.append(solution)
        target = min(solution.predicted_peak_bytes - 1, target - stride)
    return _distinct(step, problem, _thinned(solutions, top), set())


def segment_counts(step: Step, chain: Chain) -> list[Candidate]:
    """Chen's plans with every segment count, all segments but the last recomputed: one segment
    recomputes nothing, ``n`` every block but the last."""
    out = []
    for count in range(1, len(chain) + 1):
        regions = chain_regions(step, chain, chain_segments(chain, split(len(chain), count)[:-1]))
        notes = f"{count} segments of ~{len(chain) / count:.1f} stages"
        out.append(Candidate("sqrt", None, notes, regions, predicted(step, regions)))
    return out


def frontier(
    trace: Trace,
    solver: str = "auto",
    block_key: Callable[[str], str] | None = None,
    *,
    executor_cost: ExecutorCost | None = None,
    rerun_modules: bool = False,
    within_blocks: bool = False,
    **options: Any,
) -> Frontier:
    """The candidates of ``solver`` for the step ``trace`` captured (see the module doc);
    ``options`` go to the solver (``segments`` for ``sqrt`` gives its one plan). Every candidate is
    predicted with ``executor_cost`` (NOTE [executor cost]; by default the figures measured on the
    trace's device, once per process); ``rerun_modules``: see ``remat.plan``. With it the
    candidates are found twice, with whole-module regions run again and with every region on the
    tape, and the front is taken of both: running a module again holds what its call holds, which
    can be more than the tape's replay holds, so asking for it must not raise the floor.
    ``within_blocks``: only the candidates none of whose regions spans two blocks."""
    executor = measured(trace.device) if executor_cost is None else executor_cost
    steps = [
        Step(trace, block_key, executor, again) for again in ((False, True) if rerun_modules else (False,))
    ]
    get(solver)
    start = time.perf_counter()
    baseline = predicted(steps[0], []).peak_bytes
    chain = chain_from_trace(trace, key=block_key)
    tried = [c for step in steps for c in _candidates(step, solver, chain, baseline, options)]
    if within_blocks:
        tried = [c for c in tried if all(_one_block(steps[0], ops.ops) for _, ops in c.regions)]
    return Frontier(
        solver,
        steps[-1],
        chain,
        baseline,
        tuple(pareto(untied(tried))),
        time.perf_counter() - start,
    )


def _one_block(step: Step, ops: Sequence[int]) -> bool:
    """Whether the trace ops ``ops`` all belong to one block of ``step``."""
    return len({step.key(step.trace.ops[i].module) for i in ops}) <= 1


def _chains(step: Step, chain: Chain, most: int = _FINE_STAGES) -> list[Chain]:
    """The chains the solvers plan on: ``chain`` (of ``step``'s blocks), and the chain of their
    children where it has more stages, but not more than ``most``.

    NOTE [finer chains] Planning a block's children apart (its MLP recomputed, its attention kept)
    is often cheaper than whole blocks at the same peak, the more so where the executor's cost per
    op counts (fewer ops recorded and replayed): on a 12-layer GPT-2 (83 finer stages) the plans of
    the greedy ladder on the finer chain cost a fifth less than the best of the blocks' chain. So
    the cheap solvers plan on the finer chain at any length; the chain DP, cubic in the stages,
    only up to ``_FINE_STAGES``."""
    fine = chain_from_trace(step.trace, key=finer_key(step.key))
    return [chain] + ([fine] if len(chain) < len(fine) <= most else [])


def floors(step: Step, chain: Chain) -> list[Candidate]:
    """The plans near the smallest peak (``remat.planner.search.floor``) on each chain the solvers
    plan on: the minimum an error names, whichever solver was asked (the chain solver's plans on
    the finer chain reach lower than the coarse chain's floor)."""
    return [c for problem in _chains(step, chain) for c in floor(step, problem)]


def _candidates(
    step: Step, solver: str, chain: Chain, baseline: int, options: dict[str, Any]
) -> list[Candidate]:
    """``solver``'s candidates on ``step``, whose chain of blocks is ``chain``."""
    trace = step.trace
    if solver not in ("auto", "chain"):  # before the solves, which refuse a budget alike
        check_options(solver, get(solver).function, options)
    elif solver == "auto":  # its options go to the chain DP's: named as the solver asked for
        check_options(solver, chain_dp.plans, options)
    every = _chains(step, chain, most=2**31)  # NOTE [finer chains]
    chains = [c for c in every if c is chain or len(c) <= _FINE_STAGES]
    tried: list[Candidate] = []
    if solver == "auto":
        # the plans of a finer chain than the DP takes are kept and filled apart: filling only
        # what no other plan beats before filling would drop a block plan that a fill makes the
        # cheapest at its peak (a Llama's chain DP plan at per-layer checkpointing's peak)
        beyond: list[Candidate] = []
        for group, problems in ((tried, chains), (beyond, [c for c in every if c not in chains])):
            for problem in problems:
                if group is tried:  # the chain DP's, cubic in the stages
                    group += ladder(step, "chain", problem, {"single_level": True, **options})
                group += ladder(step, "greedy", problem, {})
                group += segment_counts(step, problem)  # sqrt's plans, every segment count
            if group is tried:
                group += simple(step, chain) + floor(step, chain)
            group += keeping_compute(step, pareto(group))
            group += filled_all(step, pareto(group))
        tried += beyond
    elif solver in ("chain", "greedy"):
        extra = {"single_level": True} if solver == "chain" else {}
        for problem in chains if solver == "chain" else every:
            tried += ladder(step, solver, problem, {**extra, **options})
    elif solver == "sqrt" and "segments" not in options:
        for problem in every:
            tried += segment_counts(step, problem)
    elif Chain in get(solver).problems:
        tried += ladder(step, solver, chain, options)
    elif OffloadProblem in get(solver).problems:
        pass  # a three-way solver plans over a link (remat.planner.offload_search.offload_frontier)
    else:
        dag = dag_from_trace(trace, max_nodes=None)
        tried += milp_rungs(step, solver, dag, baseline, options)
    return tried


def milp_rungs(
    step: Step, solver: str, dag: Problem, baseline: int, options: dict[str, Any]
) -> list[Candidate]:
    """The plans of a slow solver at ``_MILP_RUNGS`` step budgets spread evenly from the smallest
    peak of the chain DP's and plain checkpointing's plans (``floor``) to the plain peak, each
    found by ``search`` (the solver's budget lowered while the step's peak is over it)."""
    chain = chain_from_trace(step.trace, key=step.key)
    low = min(c.pred.peak_bytes for c in floor(step, chain))
    out: list[Candidate] = []
    for k in range(_MILP_RUNGS):
        budget = low + (baseline - low) * k // (_MILP_RUNGS - 1)
        out += search(step, solver, dag, budget, baseline, options)
    return out
