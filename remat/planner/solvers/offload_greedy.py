"""The fast three-way plan: offload or recompute, cheapest seconds per byte at the peak first.

Why a heuristic beside the MILP: the MILP, exact for NOTE [offload model], has three binaries per
saved tensor and step, too many for a ResNet-50's hundreds of saved tensors, while a plan is wanted
in a second (the MILP is the reference the rule is tested against: on small chains it is never
predicted slower, ``tests/planner/test_offload_milp_exact.py``). Each round looks at the step
holding the peak and weighs every action that lowers it: offloading a saved tensor (its copy out
issued as soon as it is made and leaving when the copy completes, or, where that is after the
peak, waited for just before it; its copy back issued as late as the link, with the reloads
already issued, still brings it back before it is needed) or recomputing a stage. The actions are
ranked by an estimate of their added seconds per byte removed at the peak, read off the current
plan's timeline; the best few of each kind (more where none of those lowers the peak) are
evaluated exactly, and the one of fewest added seconds per byte wins, until the plan fits. Then it
undoes, last first, the actions the plan no longer needs.
"""

from __future__ import annotations

import dataclasses

from remat._errors import RematValueError, message
from remat.planner.offload_model import (
    Move,
    OffloadCost,
    OffloadProblem,
    OffloadSchedule,
    OffloadSolution,
    evaluate,
    offload_solution,
)
from remat.planner.solvers.registry import register

__all__ = ["OffloadFailed", "solve"]

_EXACT = 4  # actions of each kind evaluated exactly per round, the best by their estimate


class OffloadFailed(RematValueError):
    """The greedy rule found no three-way plan within the budget."""


Action = Move | int


def _with(schedule: OffloadSchedule, action: Action) -> OffloadSchedule:
    if isinstance(action, Move):
        moves = tuple(sorted((*schedule.moves, action), key=lambda m: m.item))
        return OffloadSchedule(schedule.recompute, moves)
    return OffloadSchedule(schedule.recompute | {action}, schedule.moves)


def _estimates(
    problem: OffloadProblem, schedule: OffloadSchedule, cost: OffloadCost, peak: int, recompute: bool
) -> list[tuple[float, int, Action]]:
    """Every action that lowers the peak at step ``peak``: (estimated added seconds, bytes removed
    there, the action)."""
    items, link, n = problem.items, problem.link, len(problem.chain)
    ends = cost.ends
    moved = {m.item for m in schedule.moves}
    host = sum(items[i].nbytes for i in moved)
    issued_back = [0.0] * (problem.steps + 1)  # h2d seconds issued before each step
    for m in schedule.moves:
        issued_back[m.back + 1] += link.h2d_seconds(items[m.item].nbytes)
    for s in range(problem.steps):
        issued_back[s + 1] += issued_back[s]
    busy = [0.0] * problem.steps  # when the d2h stream is done with the copies issued up to each step
    for m in sorted(schedule.moves, key=lambda m: (m.out, m.item)):
        start = max(ends[m.out - 1], busy[m.out])
        busy[m.out] = start + link.d2h_seconds(items[m.item].nbytes)
    for s in range(1, problem.steps):
        busy[s] = max(busy[s], busy[s - 1])
    out: list[tuple[float, int, Action]] = []
    for i, item in enumerate(items):
        if i in moved or not item.movable or item.nbytes <= 0 or item.readers & schedule.recompute:
            continue  # an empty storage (a CUDA kernel's CPU-side seed, say) frees nothing
        if item.recomputable and item.stage in schedule.recompute or not item.until < peak < item.need:
            continue
        if problem.host_budget is not None and host + item.nbytes > problem.host_budget:
            continue
        out_at = item.stage + 1
        done = max(ends[item.stage], busy[out_at]) + link.d2h_seconds(item.nbytes)
        late = max(0.0, done - ends[peak - 1])
        gone = None if late == 0.0 or peak - 1 < out_at else peak - 1
        reload, need_at = link.h2d_seconds(item.nbytes), ends[item.need - 1]
        back = peak + 1
        for b in range(item.need - 1, peak, -1):
            if need_at - ends[b - 1] >= reload + issued_back[item.need] - issued_back[b]:
                back = b
                break
        if back <= (gone if gone is not None else out_at) or back >= item.need:
            continue
        behind = max(0.0, reload - (need_at - ends[back - 1]))
        out.append((late + behind, item.nbytes, Move(i, out_at, back, gone)))
    for k in range(n - 1 if recompute else 0):
        if k in schedule.recompute:
            continue
        mine = [i for i, it in enumerate(items) if it.recomputable and it.stage == k]
        if not mine or moved & set(mine) or any(k in items[i].readers for i in moved):
            continue
        gain = sum(items[i].nbytes for i in mine if items[i].until < peak < items[i].need)
        if gain > 0:
            out.append((problem.chain.stages[k].forward_cost, gain, k))
    return out


@register(
    "offload_greedy",
    "fast three-way baseline: offload or recompute the cheapest seconds per byte at the peak",
    (OffloadProblem,),
)
def solve(problem: OffloadProblem, budget_bytes: int, *, recompute: bool = True) -> OffloadSolution:
    """A three-way plan by the greedy rule of the module doc (offload alone without
    ``recompute``); ``OffloadFailed`` when none fits."""
    schedule = OffloadSchedule()
    cost = evaluate(problem, schedule)
    taken: list[Action] = []
    while cost.peak_bytes > budget_bytes:
        peak = cost.memory.index(cost.peak_bytes)
        options = sorted(
            _estimates(problem, schedule, cost, peak, recompute), key=lambda o: (o[0] / o[1], -o[1])
        )
        best: tuple[tuple[float, int], Action, OffloadSchedule, OffloadCost] | None = None
        moving = [o for o in options if isinstance(o[2], Move)]
        again = [o for o in options if not isinstance(o[2], Move)]
        for k, (_, _, action) in enumerate(moving[:_EXACT] + again[:_EXACT] + moving[_EXACT:]):
            if k >= 2 * _EXACT and best is not None:
                break
            trial = _with(schedule, action)
            trial_cost = evaluate(problem, trial)
            if isinstance(action, Move) and trial_cost.gone_step(action.item) >= peak > action.out:
                # the copies out ahead of it keep it on the device past the peak: wait for it there
                action = dataclasses.replace(action, gone=peak - 1)
                trial = _with(schedule, action)
                trial_cost = evaluate(problem, trial)
            removed = cost.memory[peak] - trial_cost.memory[peak]
            if removed <= 0:
                continue
            rank = (max(0.0, trial_cost.total_cost - cost.total_cost) / removed, -removed)
            if best is None or rank < best[0]:
                best = (rank, action, trial, trial_cost)
        if best is None:
            raise OffloadFailed(
                message(
                    "plan",
                    "the greedy three-way rule found no plan within the budget",
                    f"budget {budget_bytes} bytes; {cost.peak_bytes} bytes left at {cost.peak_at}",
                    "raise the budget or the host budget, or use solver='offload_milp'",
                )
            )
        _, action, schedule, cost = best
        taken.append(action)
    for action in reversed(taken):  # undo what the plan no longer needs
        stages = set(schedule.recompute) - ({action} if isinstance(action, int) else set())
        moves = tuple(m for m in schedule.moves if m != action)
        trial = OffloadSchedule(frozenset(stages), moves)
        trial_cost = evaluate(problem, trial)
        if trial_cost.peak_bytes <= budget_bytes and trial_cost.total_cost <= cost.total_cost:
            schedule, cost = trial, trial_cost
    note = f"{len(schedule.moves)} tensors offloaded, {len(schedule.recompute)} stages recomputed"
    return offload_solution(problem, schedule, "offload_greedy", budget_bytes, None, note)
