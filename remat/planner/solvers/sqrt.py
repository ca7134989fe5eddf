"""Chen et al.'s sqrt(n) checkpointing, as a baseline the optimal solvers are measured against.

Why keep a rule that ignores the budget: it is what most users run (``checkpoint_sequential`` with
sqrt(n) segments), so a plan is only worth its solve time if it beats this one. The stages (chain)
or forward nodes in index order (DAG) are cut into ~sqrt(n) equal segments; every segment but the
last is checkpointed: only its input (chain) or its last node (DAG) is kept, and the rest is
recomputed before its backward. Its peak and cost come from the same cost model as the other
solvers'; when they do not fit the budget it says so rather than return a plan that does not fit.
"""

from __future__ import annotations

import math

from remat._errors import RematValueError, message
from remat.planner.bounds import require
from remat.planner.cost_model import solution
from remat.planner.single_level import chain_segments, dag_from_saved
from remat.planner.solvers.registry import register
from remat.planner.types import Chain, Problem, Schedule, Solution

__all__ = ["solve", "split"]


def split(n: int, count: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` of ``count`` (default round(sqrt(n))) near-equal segments of ``range(n)``."""
    count = max(1, min(n, count if count is not None else round(math.sqrt(n))))
    bounds = [round(i * n / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@register("sqrt", "Chen et al.: ~sqrt(n) equal segments, all but the last recomputed (baseline)")
def solve(problem: Problem, budget_bytes: int, *, segments: int | None = None) -> Solution:
    """Chen's plan for ``problem`` with ``segments`` segments (default round(sqrt(n))); a
    RematValueError when its peak does not fit ``budget_bytes``."""
    require(problem, budget_bytes)
    if segments is not None and (isinstance(segments, bool) or not isinstance(segments, int) or segments < 1):
        raise RematValueError(
            message("plan", "segments must be a whole number of at least 1", repr(segments), "e.g. 4")
        )
    schedule: Schedule
    if isinstance(problem, Chain):
        parts, kind = split(len(problem), segments), "stages"
        schedule = chain_segments(problem, parts[:-1])
    else:
        parts, kind = split(len(problem.nodes), segments), "nodes"
        kept = {end - 1 for _, end in parts[:-1]} | {i for i in problem.saved if i >= parts[-1][0]}
        schedule = dag_from_saved(problem, kept)
    note = f"{len(parts)} segments of ~{parts[-1][1] / len(parts):.1f} {kind}"
    result = solution(problem, schedule, "sqrt", budget_bytes, None, note)
    if result.predicted_peak_bytes > budget_bytes:
        raise RematValueError(
            message(
                "plan",
                "the sqrt plan does not fit the budget",
                f"peak {result.predicted_peak_bytes} > budget {budget_bytes} bytes with {note}",
                "use solver='chain' or 'milp' (optimal for the budget), or a larger budget",
            )
        )
    return result
