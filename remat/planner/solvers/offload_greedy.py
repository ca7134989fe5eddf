"""The fast three-way plan: offload or recompute, cheapest seconds per byte at the peak first.

Why a heuristic beside the MILP: the MILP has a binary per saved tensor and step, too many for a
ResNet-50's hundreds of saved tensors, while a plan is wanted in a second. Each round looks at the
step holding the peak (NOTE [offload model]) and weighs every action that lowers it: offloading a
saved tensor (its copy out placed in the step before the peak where it stalls least, the earliest of
those, its copy back after the peak likewise, the latest: the link's load per step is kept so a
placement's added stall is known at once) or recomputing a stage. It takes the one of
fewest added seconds per byte removed at the peak, until the plan fits; then it undoes, last first,
the actions the plan no longer needs. Its plans lie in the MILP's space, so the MILP's are never
worse.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat._errors import RematValueError, message
from remat.planner.offload_model import (
    Move,
    OffloadProblem,
    OffloadSchedule,
    OffloadSolution,
    backward_step,
    evaluate,
    offload_solution,
    presence,
)
from remat.planner.solvers.registry import register

__all__ = ["OffloadFailed", "solve"]


class OffloadFailed(RematValueError):
    """The greedy rule found no three-way plan within the budget."""


@dataclass
class _State:
    """The plan being built, with the per-step compute, link loads and memory it implies."""

    problem: OffloadProblem
    recompute: set[int]
    moves: dict[int, Move]
    compute: list[float]
    d2h: list[float]
    h2d: list[float]
    memory: list[int]
    host: int = 0

    def stall(self, s: int, d2h: float = 0.0, h2d: float = 0.0, extra: float = 0.0) -> float:
        c = self.compute[s] + extra
        return max(0.0, self.d2h[s] + d2h - c, self.h2d[s] + h2d - c)

    def move_cost(self, i: int, peak: int) -> tuple[float, int, Move] | None:
        """The least added seconds of offloading item ``i`` and the bytes it removes at step ``peak``."""
        item, link = self.problem.items[i], self.problem.link
        if i in self.moves or not item.movable or item.readers & self.recompute:
            return None
        if item.recomputable and item.stage in self.recompute:
            return None
        if self.problem.host_budget is not None and self.host + item.nbytes > self.problem.host_budget:
            return None
        if not item.until < peak < item.need:  # on the device at the peak whatever happens
            return None
        out_time, back_time = link.d2h_seconds(item.nbytes), link.h2d_seconds(item.nbytes)
        outs = range(item.stage + 1, min(peak, item.need - 2) + 1)
        backs = range(peak + 1, item.need)
        if not outs or not backs:
            return None
        # the copy out where it stalls least, earliest of those; the copy back likewise, latest
        out = min(outs, key=lambda s: (self.stall(s, d2h=out_time) - self.stall(s), s))
        back = min(backs, key=lambda s: (self.stall(s, h2d=back_time) - self.stall(s), -s))
        added = (
            self.stall(out, d2h=out_time)
            - self.stall(out)
            + self.stall(back, h2d=back_time)
            - self.stall(back)
        )
        return added, item.nbytes, Move(i, out, back)

    def recompute_cost(self, k: int, peak: int) -> tuple[float, int] | None:
        """The added seconds of recomputing stage ``k`` and the bytes it removes at step ``peak``."""
        problem = self.problem
        n = len(problem.chain)
        if k in self.recompute or k >= n - 1:
            return None
        mine = [i for i, it in enumerate(problem.items) if it.recomputable and it.stage == k]
        if not mine or any(i in self.moves for i in mine):
            return None
        if any(k in problem.items[i].readers for i in self.moves):
            return None
        gain = sum(problem.items[i].nbytes for i in mine if presence(problem.items[i], peak, False, None))
        gain -= sum(problem.items[i].nbytes for i in mine if presence(problem.items[i], peak, True, None))
        if gain <= 0:
            return None
        s, f = backward_step(n, k), problem.chain.stages[k].forward_cost
        return f + self.stall(s, extra=f) - self.stall(s), gain

    def apply_move(self, move: Move) -> None:
        item, link = self.problem.items[move.item], self.problem.link
        for s in range(item.stage, item.freed + 1):
            if not presence(item, s, False, move):
                self.memory[s] -= item.nbytes
        self.d2h[move.out] += link.d2h_seconds(item.nbytes)
        self.h2d[move.back] += link.h2d_seconds(item.nbytes)
        self.moves[move.item] = move
        self.host += item.nbytes

    def apply_recompute(self, k: int) -> None:
        problem = self.problem
        for it in problem.items:
            if it.recomputable and it.stage == k:
                for s in range(it.stage, it.freed + 1):
                    if not presence(it, s, True, None):
                        self.memory[s] -= it.nbytes
        self.compute[backward_step(len(problem.chain), k)] += problem.chain.stages[k].forward_cost
        self.recompute.add(k)

    def schedule(self) -> OffloadSchedule:
        return OffloadSchedule(frozenset(self.recompute), tuple(self.moves[i] for i in sorted(self.moves)))


@register(
    "offload_greedy",
    "fast three-way baseline: offload or recompute the cheapest seconds per byte at the peak",
    (OffloadProblem,),
)
def solve(problem: OffloadProblem, budget_bytes: int, *, recompute: bool = True) -> OffloadSolution:
    """A three-way plan by the greedy rule of the module doc (offload alone without
    ``recompute``); ``OffloadFailed`` when none fits."""
    plain = evaluate(problem, OffloadSchedule())
    steps = problem.steps
    state = _State(
        problem,
        set(),
        {},
        [problem.compute(s) for s in range(steps)],
        [0.0] * steps,
        [0.0] * steps,
        list(plain.memory),
    )
    taken: list[Move | int] = []
    while max(state.memory) > budget_bytes:
        peak = state.memory.index(max(state.memory))
        options: list[tuple[float, int, Move | int]] = []
        for i in range(len(problem.items)):
            found = state.move_cost(i, peak)
            if found is not None:
                options.append((found[0], found[1], found[2]))
        for k in range(len(problem.chain) if recompute else 0):
            again = state.recompute_cost(k, peak)
            if again is not None:
                options.append((again[0], again[1], k))
        if not options:
            raise OffloadFailed(
                message(
                    "plan",
                    "the greedy three-way rule found no plan within the budget",
                    f"budget {budget_bytes} bytes; {max(state.memory)} bytes left at "
                    f"{problem.step_name(peak)}",
                    "raise the budget or the host budget, or use solver='offload_milp'",
                )
            )
        added, gain, action = min(options, key=lambda o: (o[0] / o[1], -o[1]))
        if isinstance(action, Move):
            state.apply_move(action)
        else:
            state.apply_recompute(action)
        taken.append(action)
    schedule = state.schedule()
    cost = evaluate(problem, schedule)
    for action in reversed(taken):  # undo what the plan no longer needs
        stages = set(schedule.recompute) - ({action} if isinstance(action, int) else set())
        moves = tuple(m for m in schedule.moves if m != action)
        trial = OffloadSchedule(frozenset(stages), moves)
        trial_cost = evaluate(problem, trial)
        if trial_cost.peak_bytes <= budget_bytes and trial_cost.total_cost <= cost.total_cost:
            schedule, cost = trial, trial_cost
    note = f"{len(schedule.moves)} tensors offloaded, {len(schedule.recompute)} stages recomputed"
    return offload_solution(problem, schedule, "offload_greedy", budget_bytes, None, note)
