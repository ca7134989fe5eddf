"""Single-level schedules: what plain checkpointing runs, as schedules of a Chain or a Dag.

Why apart from the solvers: a schedule where each value is recomputed at most once, from what the
forward kept, is what an executor runs without re-entering a model's code, and several users need
the same one: the heuristics (``greedy``, ``sqrt``) build their plans from it, ``remat.plan`` weighs
plain checkpointing against the solvers' plans, and the tests enumerate it for brute force.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from remat.planner.cost_model import schedule_cost
from remat.planner.types import Chain, ChainOp, ChainSchedule, ChainStep, Dag, DagSchedule, DagStage

__all__ = ["chain_segments", "closure", "dag_from_saved", "model_peak"]


def chain_segments(chain: Chain, segments: Iterable[tuple[int, int]]) -> ChainSchedule:
    """Checkpointing of the stage ranges ``[start, end)`` in ``segments`` (disjoint): each runs
    without grad keeping only its input, and again with grad just before its backward; every other
    stage runs once with grad (``remat.checkpoint_sequential``'s schedule). The last stage always
    runs with grad: its backward comes first, so a checkpoint there would be recomputed at once."""
    last = len(chain) - 1
    starts = {s: min(e, last) for s, e in segments if min(e, last) > s}
    forward: list[ChainStep] = []
    backward: list[ChainStep] = []
    k = 0
    while k < len(chain):
        end = starts.get(k, k)
        if end > k:
            forward += [ChainStep(ChainOp.F_CHECK, k)] + [
                ChainStep(ChainOp.F_NOGRAD, j) for j in range(k + 1, end)
            ]
            again = [ChainStep(ChainOp.F_ALL, j) for j in range(k, end)]
            backward = again + [ChainStep(ChainOp.BACKWARD, j) for j in reversed(range(k, end))] + backward
            k = end
        else:
            forward.append(ChainStep(ChainOp.F_ALL, k))
            backward.insert(0, ChainStep(ChainOp.BACKWARD, k))
            k += 1
    return ChainSchedule(tuple(forward + backward))


def closure(dag: Dag, targets: Iterable[int], present: Callable[[int], bool]) -> set[int]:
    """The nodes to compute so that ``targets`` exist, given which nodes are ``present``."""
    out: set[int] = set()
    stack = [t for t in targets if not present(t)]
    while stack:
        i = stack[-1]
        if i in out:
            stack.pop()
            continue
        missing = [d for d in dag.nodes[i].deps if not present(d) and d not in out]
        if missing:
            stack += missing
        else:
            out.add(i)
            stack.pop()
    return out


def dag_from_saved(dag: Dag, saved: Collection[int]) -> DagSchedule:
    """The schedule of an executor that keeps the nodes ``saved`` from the forward pass to their
    last use in backward and recomputes any other value a backward step reads just before it (with
    the ancestors it needs that are not in memory). A recomputed value stays until the last step
    that reads it; everything else is freed after its last use. Linear in the dag's size plus
    the recomputation."""
    n, steps = len(dag.nodes), dag.backward
    kept = set(saved)
    last_read = [-1] * n
    for j, step in enumerate(steps):
        for r in step.reads:
            last_read[r] = j
    last_use: dict[int, int] = {}  # node -> last stage that reads it or recomputes from it
    computes: list[tuple[int, ...]] = []
    drops: list[list[int]] = [[] for _ in range(n + len(steps))]
    cached: set[int] = set()  # recomputed values still to be read by a later step
    for j, step in enumerate(steps):
        made = closure(dag, step.reads, lambda i: i in kept or i in cached)  # noqa: B023 (called now)
        for i in [*step.reads, *(d for c in made for d in dag.nodes[c].deps)]:
            last_use[i] = n + j
        computes.append(tuple(sorted(made)))
        for i in made:
            if last_read[i] > j:
                cached.add(i)
                drops[n + last_read[i]].append(i)  # kept until the last step that reads it
            else:
                drops[n + j].append(i)
        cached.difference_update(i for i in step.reads if last_read[i] == j)
    for i in range(n):
        if i in kept and i in last_use:
            drops[last_use[i]].append(i)
        else:
            drops[max((i, *dag.users[i]))].append(i)
    stages = [DagStage(((t,) if t < n else computes[t - n]), tuple(sorted(d))) for t, d in enumerate(drops)]
    return DagSchedule(tuple(stages))


def model_peak(problem: Chain | Dag) -> int:
    """The solver model's peak with nothing recomputed."""
    if isinstance(problem, Chain):
        return schedule_cost(problem, chain_segments(problem, [])).peak_bytes
    return schedule_cost(problem, dag_from_saved(problem, problem.saved)).peak_bytes
