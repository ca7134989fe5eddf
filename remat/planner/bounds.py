"""The smallest peak a budget must allow: exact for a chain, a lower bound for a Dag.

Why a check of its own: a heuristic that fails says little (a smarter plan may fit), so before
running one the budget is compared with the smallest peak any plan can have: exact for a chain
(the min-memory recursion, ``remat.planner.chain_recursion``), a lower bound for a DAG (each
forward node with its deps, each backward step with its reads; the exact figure needs the MILP).
``below_minimum`` is the one error every solver raises for a budget below it.
"""

from __future__ import annotations

from remat._errors import RematValueError, message
from remat._units import format_bytes
from remat.planner.chain_recursion import minimum_peak
from remat.planner.cost_model import schedule_cost
from remat.planner.types import Chain, Dag, Problem

__all__ = ["below_minimum", "lower_bound", "require"]


def require(problem: Problem, budget: int) -> None:
    """Raise ``below_minimum`` when no plan of ``problem`` can fit ``budget`` bytes."""
    if isinstance(problem, Chain):
        minimum, schedule = minimum_peak(problem)
        if budget < minimum:
            raise below_minimum(budget, minimum, schedule_cost(problem, schedule).peak_at)
        return
    bound, where = lower_bound(problem)
    if budget < bound:
        raise below_minimum(budget, bound, where, exact=False)


def lower_bound(dag: Dag) -> tuple[int, str]:
    """A peak no schedule can beat, and where: each forward node with its deps, and each backward
    step with its reads and its live bytes."""
    best, where = 0, "start"
    for k, node in enumerate(dag.nodes):
        need = node.bytes + sum(dag.nodes[d].bytes for d in set(node.deps))
        if need > best:
            best, where = need, f"forward {k} ({node.name})"
    for j, step in enumerate(dag.backward):
        need = step.live_bytes + sum(dag.nodes[r].bytes for r in set(step.reads))
        if need > best:
            best, where = need, f"backward step {j} ({step.name})"
    return best, where


def below_minimum(budget: int, minimum: int, where: str, exact: bool = True) -> RematValueError:
    """The error for a budget no plan fits: the smallest feasible peak (or, when only a bound is
    known, a peak no plan can beat) and the stage or op that needs it."""
    figure = f"the minimum is {minimum} bytes" if exact else f"the minimum is at least {minimum} bytes"
    return RematValueError(
        message(
            "plan",
            "budget below the smallest feasible peak",
            f"budget {budget} < {minimum} bytes, {format_bytes(minimum)}",
            f"{figure} (needed by {where})",
        )
    )
