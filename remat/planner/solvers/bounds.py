"""The smallest peak a budget must allow, checked before a heuristic solver runs.

Why a check of its own: a heuristic that fails says little (a smarter plan may fit), so before
running one the budget is compared with the smallest peak any plan can have: exact for a chain
(the min-memory recursion of NOTE [chain DP]), a lower bound for a graph (each forward node with
its deps, each backward step with its reads; the exact figure needs the MILP).
"""

from __future__ import annotations

from remat.planner.problem import Chain, Problem
from remat.planner.solvers.chain_dp import minimum_peak
from remat.planner.solvers.registry import below_minimum
from remat.planner.solvers.simulate import lower_bound, simulate

__all__ = ["require"]


def require(problem: Problem, budget: int) -> None:
    """Raise ``below_minimum`` when no plan of ``problem`` can fit ``budget`` bytes."""
    if isinstance(problem, Chain):
        minimum, schedule = minimum_peak(problem)
        if budget < minimum:
            raise below_minimum(budget, minimum, simulate(problem, schedule).peak_at)
        return
    bound, where = lower_bound(problem)
    if budget < bound:
        raise below_minimum(budget, bound, where, exact=False)
