"""A fast baseline: recompute saved tensors in order of bytes freed per recompute cost until the
plan fits.

Why a heuristic next to exact solvers: the chain DP is cubic in the stages and the MILP exponential
in the worst case, while a DAG of thousands of ops needs an answer in seconds, and every optimal
plan should show what it gains over a knapsack rule. Candidates are the stages (chain) or the nodes
backward reads (DAG), ranked by bytes per unit of recompute cost: a stage's internals per its
forward cost (the stage becoming a checkpointed segment of its own, as per-block checkpointing
does), a node's bytes per the cost of recomputing it and the ancestors it would need (re-ranked
lazily, since dropping a node makes its neighbours dearer). Each round drops candidates until their
bytes cover the excess over the budget, then re-evaluates; once the plan fits, the last round's
candidates are put back, last first, wherever the plan still fits and costs no more. The plans are
single-level (``chain_segments``, ``dag_from_saved``), so an executor runs them with plain
checkpointing, and the optimal solvers can only do as well or better.
"""

from __future__ import annotations

import heapq
import math

from remat._errors import RematValueError, message
from remat.planner.bounds import require
from remat.planner.cost_model import schedule_cost, solution
from remat.planner.single_level import chain_segments, closure, dag_from_saved
from remat.planner.solvers.registry import register
from remat.planner.types import Chain, Problem, Schedule, Solution

__all__ = ["GreedyFailed", "solve"]


class GreedyFailed(RematValueError):
    """Greedy's single-level plans cannot fit the budget (a multi-level plan still may)."""


@register("greedy", "fast knapsack baseline: recompute the most bytes per recompute cost until the plan fits")
def solve(problem: Problem, budget_bytes: int) -> Solution:
    """Greedy single-level plan; ``GreedyFailed`` when none of those it tries fits."""
    require(problem, budget_bytes)
    # the last stage of a chain always runs with grad (see ``chain_segments``)
    candidates = list(range(len(problem) - 1)) if isinstance(problem, Chain) else list(problem.saved)
    dropped: set[int] = set()

    def build(out: set[int]) -> Schedule:
        if isinstance(problem, Chain):
            return chain_segments(problem, [(k, k + 1) for k in out])
        return dag_from_saved(problem, set(candidates) - out)

    def gain(c: int) -> int:
        return problem.stages[c].saved_bytes if isinstance(problem, Chain) else problem.nodes[c].bytes

    def ratio(c: int) -> float:
        if isinstance(problem, Chain):
            price = problem.stages[c].forward_cost
        else:
            again = closure(problem, [c], lambda i: i != c and i not in dropped and i in saved)
            price = math.fsum(problem.nodes[i].cost for i in again)
        return gain(c) / price if price > 0 else (math.inf if gain(c) > 0 else 0.0)

    saved = set(candidates)
    queue = [(-ratio(c), c) for c in candidates]
    heapq.heapify(queue)
    cost = schedule_cost(problem, build(dropped))
    lowest = cost.peak_bytes
    batch: list[int] = []
    while cost.peak_bytes > budget_bytes:
        if not queue:
            raise GreedyFailed(
                message(
                    "plan",
                    "greedy found no plan within the budget",
                    f"budget {budget_bytes} bytes; the lowest peak of its single-level plans was {lowest}",
                    "use solver='chain' or 'milp' (multi-level, optimal), or a larger budget",
                )
            )
        batch, freed = [], 0
        while queue and freed < cost.peak_bytes - budget_bytes:
            _, c = heapq.heappop(queue)
            fresh = -ratio(c)
            if queue and fresh > queue[0][0]:  # dearer than it was: re-rank
                heapq.heappush(queue, (fresh, c))
                continue
            batch.append(c)
            dropped.add(c)
            freed += gain(c)
        cost = schedule_cost(problem, build(dropped))
        lowest = min(lowest, cost.peak_bytes)
    for c in reversed(batch):
        trial = schedule_cost(problem, build(dropped - {c}))
        if trial.peak_bytes <= budget_bytes and trial.total_cost <= cost.total_cost:
            dropped.discard(c)
            cost = trial
    kind = "stages" if isinstance(problem, Chain) else "saved nodes"
    note = f"{len(dropped)} of {len(candidates)} {kind} recomputed"
    return solution(problem, build(dropped), "greedy", budget_bytes, None, note)
