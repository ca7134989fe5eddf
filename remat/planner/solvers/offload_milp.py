"""The exact three-way plan: an MILP choosing SAVE, RECOMPUTE or OFFLOAD per saved tensor.

Why an MILP: where a transfer hides depends on every other transfer sharing the link, and on which
stages recompute (a replay lengthens its backward step, and so hides more), so the choices do not
decompose by tensor. The program encodes NOTE [offload model] whole: the compute's timeline, the
two streams of copies in issue order (a copy may run over several steps) and the host's
``per_move`` seconds, so for fixed choices its least time is the model's time. Its optimum is the
model's over every schedule whose moves name the step they leave after (``Move.gone``); a move
with ``gone=None`` costs what the same move with ``gone`` the step its copy completes in costs, or
moves nothing off the device where that is not before its copy back (then leaving it on the device
is no slower), so the optimum is the model's over every schedule it accepts (tested against
enumeration: ``tests/planner/test_offload_milp_exact.py``). HiGHS solves it through
``scipy.optimize.milp`` (imported when a plan is solved) with a time limit, and the figures are
re-evaluated by ``remat.planner.offload_model``.

The price of exactness is size and a weak relaxation (the stream rows hold through big-M terms):
on a tiny GPT-2's 50 movable tensors in 46 steps HiGHS takes seconds where the earlier program
(each copy within one step, ``per_move`` left out) took one, and may stop at its time limit
(benchmarks/offload/README.md). So ``solve`` bounds the program's time by the greedy rule's plan
(scipy's HiGHS takes no starting plan) and answers that plan where HiGHS finds none faster.

NOTE [offload MILP] Binaries r_k (stage k recomputed, k < n-1), and per movable item i: w[i,s]
(its copy out issued in step s, stage_i < s < need_i - 1), x[i,g] (it leaves after step g, the
compute waiting there for its copy out, stage_i < g < need_i - 1) and v[i,b] (its copy back issued
in step b, stage_i + 1 < b < need_i). Continuous times, in units of the plain step's time: S_s and
E_s (step s's compute starts, after the waits for copies back, and ends, after the waits for copies
out), G_s and K_s (the copies out, and back, issued in step s begin: each stream runs its copies
one at a time, in issue order), O_i and B_i (item i's copy out and back are done). A row per fact
of the model:
- one move at most: sum_s w[i,s] <= 1, and sum_s x[i,s] = sum_s v[i,s] = sum_s w[i,s];
- order: sum_{s'<=s} x[i,s'] <= sum_{s'<=s} w[i,s'] (out <= gone) and sum_{s'<=s} v[i,s'] <=
  sum_{s'<s} x[i,s'] (gone < back), so the copy out is done before the copy back begins;
- an item its stage drops, or a recomputed stage reads, stays: sum_s w[i,s] + r_k <= 1;
- steps in turn: S_s >= E_{s-1}; E_s >= S_s + c_s + f_k r_k + per_move sum_i w[i,s] (f_k r_k in
  the backward step of stage k: its replay);
- streams: G_s >= S_s (copies are issued once the waits for copies back are done), G_s >=
  G_{s'} + sum_i d2h_i w[i,s'] for the step s' < s copies were last issued in; K_s likewise with
  h2d_i and v;
- in issue order (by item within a step): O_i >= G_s + sum_{j<=i} d2h_j w[j,s] - M (1 - w[i,s]),
  and B_i >= K_s + sum_{j<=i} h2d_j v[j,s] - M (1 - v[i,s]);
- waits: E_g >= O_i - M (1 - x[i,g]); S_{need_i} >= B_i;
- memory: gradients_s + sum_i m_i p[i,s] <= budget, with p[i,s] = 1 outside until_i < s < need_i
  and inside it 1 - r_k (a recomputable item) - sum_{s'<s} x[i,s'] + sum_{s'<=s} v[i,s'];
- host: sum_i m_i sum_s w[i,s] <= host_budget.
M is the sum of every duration in the problem (every compute, replay, per-move charge and copy),
which no time of the model exceeds. The rows only bound the times from below and each is the
model's max-plus recurrence, so for fixed binaries the least E_{last} is the model's time. With
the greedy rule's plan at hand, also E_{last} <= its time. Objective: E_{last}, plus a trifle per
move (``_TRIFLE`` of its link time, so that of equally fast plans the one moving least wins) and a
smaller one per x[i,g] growing with g (so that a move leaves at the earliest step that costs no
time); ``mip_rel_gap`` is relative to the whole step's time. Each memory and host row is in units
of its largest term, so that HiGHS's feasibility tolerance (relative to the row) lets a fraction of
an item's bytes over, not of the budget; a schedule still over is repaired (its moves leaving
sooner) or cut off and solved again (``solve``).
"""

from __future__ import annotations

import math

import numpy as np

from remat._errors import RematValueError, message
from remat.planner.offload_model import (
    Move,
    OffloadProblem,
    OffloadSchedule,
    OffloadSolution,
    evaluate,
    offload_solution,
)
from remat.planner.solvers import offload_greedy as greedy
from remat.planner.solvers.registry import register

__all__ = ["solve"]

# what a move costs in the objective, as a share of its link time: so that of plans of equal time
# the one moving least wins (the optimum is the model's up to this share of the link time moved)
_TRIFLE = 1e-3
_SAME = 1e-9  # times this close, relative, are one
_TRIES = 10  # HiGHS solves, each cutting off the schedules before it found over the budget

Terms = dict[int, float]
Issued = list[list[tuple[int, int, float]]]  # per step: (item, column, seconds) of the copies issued, by item


class _Program:
    """Columns and rows of NOTE [offload MILP] for one problem, budget and bound on the time
    (``cutoff``, seconds; ``math.inf`` for none)."""

    def __init__(self, problem: OffloadProblem, budget: int, cutoff: float) -> None:
        self.problem = problem
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.upper: list[float] = []
        self.rows: list[tuple[Terms, float, float]] = []
        n, steps, items, link = len(problem.chain), problem.steps, problem.items, problem.link
        scale = problem.base_cost or 1.0
        host = problem.host_budget
        movable = [i for i, it in enumerate(items) if it.movable and (host is None or it.nbytes <= host)]
        d2h = {i: link.d2h_seconds(items[i].nbytes) / scale for i in movable}
        h2d = {i: link.h2d_seconds(items[i].nbytes) / scale for i in movable}
        replay = {
            k: problem.chain.stages[k].forward_cost / scale
            for k in sorted({it.stage for it in items if it.recomputable})
            if k < n - 1
        }
        per_move = problem.per_move / scale
        self.big = sum(problem.computes) / scale + sum(replay.values()) + per_move * len(movable)
        self.big += sum(d2h.values()) + sum(h2d.values())
        self.r = {k: self.column() for k in replay}
        # per movable item: step -> its binary
        self.w: dict[int, dict[int, int]] = {i: {} for i in movable}
        self.x: dict[int, dict[int, int]] = {i: {} for i in movable}
        self.v: dict[int, dict[int, int]] = {i: {} for i in movable}
        outs: Issued = [[] for _ in range(steps)]
        backs: Issued = [[] for _ in range(steps)]
        for i in movable:
            span = items[i].need - items[i].stage
            for s in range(items[i].stage + 1, items[i].need - 1):
                self.w[i][s] = self.column(_TRIFLE * d2h[i])
                # leaving later costs a trifle too: of equal plans, the one holding the device least
                self.x[i][s] = self.column(_TRIFLE * d2h[i] * (s - items[i].stage) / span)
                outs[s].append((i, self.w[i][s], d2h[i]))
            for s in range(items[i].stage + 2, items[i].need):
                self.v[i][s] = self.column()
                backs[s].append((i, self.v[i][s], h2d[i]))
        self.start, self.end = [self.time() for _ in range(steps)], [self.time() for _ in range(steps)]
        self.cost[self.end[-1]] = 1.0
        if cutoff < math.inf:
            self.at_most({self.end[-1]: 1.0}, cutoff / scale)
        out_begin, back_begin = self.issue(outs), self.issue(backs)
        for s in range(steps):
            if s > 0:
                self.at_least({self.start[s]: 1.0, self.end[s - 1]: -1.0}, 0.0)
            step = {self.end[s]: 1.0, self.start[s]: -1.0, **{c: -per_move for _, c, _ in outs[s]}}
            if 2 * n - 1 - s in self.r and s >= n:
                step[self.r[2 * n - 1 - s]] = -replay[2 * n - 1 - s]
            self.at_least(step, problem.compute(s) / scale)
        fixed = [float(problem.gradients(s)) for s in range(steps)]
        memory: list[Terms] = [{} for _ in range(steps)]
        on_host: Terms = {}
        for i, it in enumerate(items):
            if i in d2h:
                out_done = self.stream(i, self.w[i], outs, out_begin)
                for g, c in self.x[i].items():
                    self.at_least({self.end[g]: 1.0, out_done: -1.0, c: -self.big}, -self.big)
                back_done = self.stream(i, self.v[i], backs, back_begin)
                self.at_least({self.start[it.need]: 1.0, back_done: -1.0}, 0.0)
                self.order(i)
                stages = set(it.readers) | ({it.stage} if it.recomputable else set())
                for k in stages & self.r.keys():
                    self.at_most({**dict.fromkeys(self.w[i].values(), 1.0), self.r[k]: 1.0}, 1.0)
                on_host.update(dict.fromkeys(self.w[i].values(), float(it.nbytes)))
            for s in range(it.stage, it.freed + 1):
                fixed[s] += it.nbytes
                if not it.until < s < it.need:
                    continue
                if it.recomputable and it.stage in self.r:
                    memory[s][self.r[it.stage]] = memory[s].get(self.r[it.stage], 0.0) - it.nbytes
                memory[s].update({c: -float(it.nbytes) for g, c in self.x.get(i, {}).items() if g < s})
                memory[s].update({c: float(it.nbytes) for b, c in self.v.get(i, {}).items() if b <= s})
        # each row in units of its largest term: HiGHS's feasibility tolerance, relative to the
        # row, then lets a fraction of the largest item over, not of the budget
        self.memory = memory
        for s in range(steps):
            if memory[s] or fixed[s] > budget:
                unit = max(map(abs, memory[s].values()), default=0.0) or float(budget)
                self.at_most({c: b / unit for c, b in memory[s].items()}, (budget - fixed[s]) / unit)
        if host is not None and on_host:
            unit = max(on_host.values()) or 1.0
            self.at_most({c: b / unit for c, b in on_host.items()}, host / unit)

    def column(self, cost: float = 0.0) -> int:
        """A binary."""
        self.cost.append(cost)
        self.integer.append(1)
        self.upper.append(1.0)
        return len(self.cost) - 1

    def time(self) -> int:
        """A continuous time (in units of the plain step's)."""
        self.cost.append(0.0)
        self.integer.append(0)
        self.upper.append(np.inf)
        return len(self.cost) - 1

    def at_least(self, terms: Terms, lo: float) -> None:
        self.rows.append((terms, lo, np.inf))

    def at_most(self, terms: Terms, hi: float) -> None:
        self.rows.append((terms, -np.inf, hi))

    def issue(self, issued: Issued) -> dict[int, int]:
        """Per step where copies may be issued on one stream, a time at least when the first of
        them begins: the step's start, after the copies issued before it are done."""
        begin: dict[int, int] = {}
        free = None  # a time at least when the stream is done with the copies issued so far
        for s, copies in enumerate(issued):
            if not copies:
                continue
            begin[s] = self.time()
            self.at_least({begin[s]: 1.0, self.start[s]: -1.0}, 0.0)
            if free is not None:
                self.at_least({begin[s]: 1.0, free: -1.0}, 0.0)
            free = self.time()
            self.at_least({free: 1.0, begin[s]: -1.0, **{c: -t for _, c, t in copies}}, 0.0)
        return begin

    def stream(self, i: int, binaries: dict[int, int], issued: Issued, begin: dict[int, int]) -> int:
        """A time at least the end of item ``i``'s copy on one stream: issued in step s, it runs
        after the copies issued before s and those of items before it issued in s."""
        done = self.time()
        for s, mine in binaries.items():
            copies = {c: -t for k, c, t in issued[s] if k <= i}
            copies[mine] -= self.big
            self.at_least({done: 1.0, begin[s]: -1.0, **copies}, -self.big)
        return done

    def order(self, i: int) -> None:
        """Item ``i`` moves at most once, leaves after its copy out is issued and comes back
        after it left."""
        outs, gones, backs = self.w[i], self.x[i], self.v[i]
        self.at_most(dict.fromkeys(outs.values(), 1.0), 1.0)
        for same in (gones, backs):
            self.rows.append(
                ({**dict.fromkeys(same.values(), 1.0), **dict.fromkeys(outs.values(), -1.0)}, 0.0, 0.0)
            )
        for s in outs:  # gone no sooner than out
            out_by = {c: -1.0 for t, c in outs.items() if t <= s}
            self.at_most({**{c: 1.0 for t, c in gones.items() if t <= s}, **out_by}, 0.0)
        for s in backs:  # back after gone
            gone_before = {c: -1.0 for t, c in gones.items() if t < s}
            self.at_most({**{c: 1.0 for t, c in backs.items() if t <= s}, **gone_before}, 0.0)

    def exclude(self, schedule: OffloadSchedule, step: int | None = None) -> None:
        """Cut off the binaries of ``schedule`` (as ``run`` found it: every ``gone`` a step): with
        ``step``, where it is over the budget, only those of that step's memory row (every schedule
        that sets them alike holds the same bytes there: all are over), else all of them."""
        ones = {self.r[k] for k in schedule.recompute}
        for m in schedule.moves:
            assert m.gone is not None
            ones |= {self.w[m.item][m.out], self.x[m.item][m.gone], self.v[m.item][m.back]}
        binaries = self.memory[step] if step is not None else [c for c, i in enumerate(self.integer) if i]
        ones &= set(binaries)
        self.at_most({c: 1.0 if c in ones else -1.0 for c in binaries}, len(ones) - 1.0)

    def run(self, time_limit: float, gap: float) -> tuple[OffloadSchedule | None, float, int]:
        """The schedule HiGHS found (None when none), its MIP gap and scipy's status."""
        # scipy (HiGHS) loads when a plan is solved, not when remat is imported
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        data = [(i, c, v) for i, (coefs, _, _) in enumerate(self.rows) for c, v in coefs.items()]
        matrix = coo_matrix(
            ([v for _, _, v in data], ([i for i, _, _ in data], [c for _, c, _ in data])),
            shape=(len(self.rows), len(self.cost)),
        )
        result = milp(
            np.array(self.cost),
            integrality=np.array(self.integer),
            bounds=Bounds(np.zeros(len(self.cost)), np.array(self.upper)),
            constraints=LinearConstraint(
                matrix.tocsr(), [lo for _, lo, _ in self.rows], [hi for *_, hi in self.rows]
            ),
            options={"time_limit": time_limit, "mip_rel_gap": gap, "disp": False},
        )
        if result.x is None:
            return None, float("nan"), result.status
        x = np.round(result.x).astype(int)
        recompute = frozenset(k for k, c in self.r.items() if x[c])
        moves = []
        for i in self.w:
            out, gone, back = ([s for s, c in b[i].items() if x[c]] for b in (self.w, self.x, self.v))
            if out and gone and back:
                moves.append(Move(i, out[0], back[0], gone[0]))
        gap_found = float(getattr(result, "mip_gap", 0.0) or 0.0)
        return OffloadSchedule(recompute, tuple(moves)), gap_found, result.status


@register(
    "offload_milp",
    "three-way MILP (HiGHS): save, recompute or offload each saved tensor, exact for the offload model",
    (OffloadProblem,),
)
def solve(
    problem: OffloadProblem, budget_bytes: int, *, time_limit: float = 30.0, mip_rel_gap: float = 1e-4
) -> OffloadSolution:
    """The fastest three-way schedule of ``problem`` whose peak fits ``budget_bytes`` under NOTE
    [offload model], within ``time_limit`` seconds and ``mip_rel_gap``. It is never predicted
    slower than the greedy rule's plan: that plan's time bounds the program's (scipy's HiGHS takes
    no starting plan), and it is the answer where it already takes the plain step's time (the
    least any plan can), where HiGHS finds none faster (stopped at the time limit, or having proved
    there is none) or where HiGHS's is no better on the program's objective (time plus the trifle
    per move: of equally fast plans, the one moving least; except where the greedy rule's plan
    takes the plain step's time, which is answered as is, however many tensors it moves)."""
    fast = _greedy(problem, budget_bytes)
    if fast is not None and fast.total_cost <= problem.base_cost * (1 + _SAME):
        note = "the greedy rule's plan takes the plain step's time, the least any plan can"
        return offload_solution(problem, fast.offload, "offload_milp", budget_bytes, 0.0, note)
    # no plan slower than the greedy rule's is wanted: HiGHS searches the faster ones only, and
    # finding none proves the greedy rule's plan the fastest
    program = _Program(problem, budget_bytes, fast.total_cost * (1 + _SAME) if fast is not None else math.inf)
    for _ in range(_TRIES):
        found, gap, status = program.run(time_limit, mip_rel_gap)
        verdict = "optimal" if status == 0 else "stopped at the time limit"
        if found is None and fast is not None:
            verdict = "found none faster" if status == 2 else "stopped at the time limit with none faster"
            note = f"HiGHS {verdict}: the greedy rule's plan"
            return offload_solution(problem, fast.offload, "offload_milp", budget_bytes, None, note)
        if found is None:
            infeasible = status == 2
            raise RematValueError(
                message(
                    "plan",
                    "no three-way plan fits the budget" if infeasible else "the MILP found no plan in time",
                    f"budget {budget_bytes} bytes, time_limit={time_limit} s",
                    "raise the budget or the host budget" if infeasible else "raise time_limit",
                )
            )
        schedule = _repaired(problem, found, budget_bytes)
        cost = evaluate(problem, schedule)
        host = problem.host_budget
        if cost.peak_bytes <= budget_bytes and (host is None or cost.host_bytes <= host):
            if fast is not None and _objective(problem, fast.offload) <= _objective(problem, schedule):
                note = f"HiGHS {verdict}, MIP gap {gap:.2e}; the greedy rule's plan was as fast"
                return offload_solution(problem, fast.offload, "offload_milp", budget_bytes, gap, note)
            note = f"HiGHS {verdict}, MIP gap {gap:.2e}"
            return offload_solution(problem, schedule, "offload_milp", budget_bytes, gap, note)
        # HiGHS's feasibility tolerance let a schedule a few bytes over through, and moving its
        # items off sooner did not bring it in: cut off what puts it over and solve again
        memory = evaluate(problem, found).memory
        over = next((t for t, held in enumerate(memory) if held > budget_bytes), None)
        program.exclude(found, over)
    if fast is not None:
        note = "HiGHS's plans kept passing the budget: the greedy rule's plan"
        return offload_solution(problem, fast.offload, "offload_milp", budget_bytes, None, note)
    raise RematValueError(
        message(
            "plan",
            "the MILP kept returning plans over the budget",
            f"budget {budget_bytes}",
            "use solver='offload_greedy'",
        )
    )


def _objective(problem: OffloadProblem, schedule: OffloadSchedule) -> float:
    """The program's objective in seconds: the schedule's time plus the trifle per move."""
    moved = (problem.link.d2h_seconds(problem.items[m.item].nbytes) for m in schedule.moves)
    return evaluate(problem, schedule).total_cost + _TRIFLE * math.fsum(moved)


def _repaired(problem: OffloadProblem, schedule: OffloadSchedule, budget_bytes: int) -> OffloadSchedule:
    """``schedule`` where its peak is over ``budget_bytes`` (HiGHS's tolerances let a few bytes
    through, and nothing in its time keeps a move's ``gone`` at the earliest step): each move
    leaving at the earliest step (``None`` first) that raises neither the time nor the peak, until
    the peak fits."""
    cost = evaluate(problem, schedule)
    for k, m in enumerate(schedule.moves):
        if cost.peak_bytes <= budget_bytes:
            break
        for gone in (None, *range(m.out, m.gone if m.gone is not None else m.out)):
            moves = (*schedule.moves[:k], Move(m.item, m.out, m.back, gone), *schedule.moves[k + 1 :])
            trial = OffloadSchedule(schedule.recompute, moves)
            trial_cost = evaluate(problem, trial)
            if trial_cost.total_cost <= cost.total_cost and trial_cost.peak_bytes <= cost.peak_bytes:
                if sum(trial_cost.memory) >= sum(cost.memory):
                    continue
                schedule, cost = trial, trial_cost
                break
    return schedule


def _greedy(problem: OffloadProblem, budget_bytes: int) -> OffloadSolution | None:
    """The greedy rule's plan, None where it finds none."""
    try:
        solution = greedy.solve(problem, budget_bytes)
    except greedy.OffloadFailed:
        return None
    assert isinstance(solution, OffloadSolution)
    return solution
