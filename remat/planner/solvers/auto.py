"""The default solver: picks the best solver for the problem's shape and size.

Why a picker: users ask for a plan, not for a solver. A chain gets the exact DP (cubic in stages,
fast for the few hundred blocks of any network); a DAG of at most ``max_milp_nodes`` nodes gets
the MILP (optimal within its time limit; Checkmate's formulation gets slow beyond a few dozen
stages, see ``remat.planner.solvers.milp``); a larger DAG gets the greedy heuristic, and the MILP
(on the DAG coarsened to its ``max_nodes``) only when greedy's single-level plans cannot fit.
"""

from __future__ import annotations

import dataclasses

from remat.planner.solvers.greedy import GreedyFailed
from remat.planner.solvers.registry import get, register
from remat.planner.types import Chain, Problem, Solution

__all__ = ["solve"]


@register(
    "auto", "chain DP for a chain, MILP for a small dag, greedy (then a coarsened MILP) for a large one"
)
def solve(problem: Problem, budget_bytes: int, *, max_milp_nodes: int = 20, **options: object) -> Solution:
    """Solve with the picked solver; ``options`` go to it."""
    if isinstance(problem, Chain):
        name, why = "chain", "a chain"
    elif len(problem.nodes) <= max_milp_nodes:
        name, why = "milp", f"a DAG of {len(problem.nodes)} <= {max_milp_nodes} nodes"
    else:
        name, why = "greedy", f"a DAG of {len(problem.nodes)} > {max_milp_nodes} nodes"
    try:
        result = get(name).solve(problem, budget_bytes, **options)
    except GreedyFailed:
        name, why = "milp", f"{why}, greedy found no plan"
        result = get(name).solve(problem, budget_bytes, **options)
    notes = "; ".join(filter(None, [f"auto picked {name} for {why}", result.notes]))
    return dataclasses.replace(result, notes=notes)
