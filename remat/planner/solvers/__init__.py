"""Plan solvers, one per module, registered by name (:func:`get`, :func:`names`).

Every solver is ``solve(problem, budget_bytes, **options) -> Solution``: ``chain`` (rotor's DP),
``milp`` (Checkmate), ``sqrt`` (Chen's baseline), ``greedy`` (knapsack baseline) and ``auto`` (picks
one). Their figures all come from the planner's cost model (``remat.planner.cost_model``);
``offload_milp`` and ``offload_greedy`` solve an ``OffloadProblem`` (save, recompute or offload),
costed by ``remat.planner.offload_model``.
"""

from remat.planner.solvers import auto, chain_dp, greedy, milp, offload_greedy, offload_milp, sqrt
from remat.planner.solvers.registry import Solver, get, names, register
from remat.planner.types import Problem, Solution

__all__ = [
    "Solver",
    "auto",
    "chain_dp",
    "get",
    "greedy",
    "milp",
    "names",
    "offload_greedy",
    "offload_milp",
    "register",
    "solve",
    "sqrt",
]


def solve(problem: Problem, budget_bytes: int | str, solver: str = "auto", **options: object) -> Solution:
    """Shorthand for ``get(solver).solve(problem, budget_bytes, **options)``."""
    return get(solver).solve(problem, budget_bytes, **options)
