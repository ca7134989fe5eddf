"""The exact three-way plan: an MILP choosing SAVE, RECOMPUTE or OFFLOAD per saved tensor.

Why an MILP: where a transfer hides depends on every other transfer sharing the link in the same
step, and on which stages recompute (a replay lengthens its backward step, and so hides more), so
the choices do not decompose by tensor. The program encodes NOTE [offload model] with each copy
placed within one step (a move's ``gone`` is its ``out``: the compute waits at the end of that
step for the copy), so its optimum is the model's over those schedules; the greedy rule's copies,
which run over several steps, can beat it where copies are longer than steps. HiGHS solves it
through ``scipy.optimize.milp`` (imported when a plan is solved) with a time limit, and the figures
are re-evaluated by ``remat.planner.offload_model``.

NOTE [offload MILP] Binaries r_k (stage k recomputed), w[i,s] (item i goes out in step s, for
stage_i < s < need_i - 1) and v[i,s] (item i comes back in step s, stage_i + 1 < s < need_i);
continuous stalls z_s >= 0. Rows:
- one move at most: sum_s w[i,s] <= 1, and back exactly when out: sum_s v[i,s] = sum_s w[i,s];
- back after out: sum_{s'<=s} v[i,s'] <= sum_{s'<s} w[i,s'];
- an item its stage drops, or a recomputed stage reads, stays: sum_s w[i,s] + r_k <= 1;
- link time: sum_i d2h_i w[i,s] - z_s - f_k r_k <= c_s (the same for h2d and v), f_k r_k only in
  the backward step of stage k;
- memory: gradients_s + sum_i m_i p[i,s] <= budget, with p[i,s] = 1 outside until_i < s < need_i
  and inside it 1 - r_k (a recomputable item) - sum_{s'<s} w[i,s'] + sum_{s'<=s} v[i,s'];
- host: sum_i m_i sum_s w[i,s] <= host_budget.
Objective: sum_k f_k r_k + sum_s z_s, the step's time above its plain compute (plus a trifle per
move, ``_TRIFLE`` of its link time, so that of equally fast plans the one moving least wins).
"""

from __future__ import annotations

import numpy as np

from remat._errors import RematValueError, message
from remat.planner.offload_model import (
    Move,
    OffloadProblem,
    OffloadSchedule,
    OffloadSolution,
    offload_solution,
)
from remat.planner.solvers.registry import register

__all__ = ["solve"]

# what a move costs in the objective, as a share of its link time: so that of plans of equal time
# the one moving least wins (the optimum is the model's up to this share of the link time moved)
_TRIFLE = 1e-3


class _Program:
    """Columns and rows of NOTE [offload MILP] for one problem and budget."""

    def __init__(self, problem: OffloadProblem, budget: int) -> None:
        self.problem = problem
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.upper: list[float] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        n, steps = len(problem.chain), problem.steps
        scale = problem.base_cost or 1.0
        self.r: dict[int, int] = {}
        for k in sorted({it.stage for it in problem.items if it.recomputable}):
            self.r[k] = self.column(problem.chain.stages[k].forward_cost / scale)
        self.w: dict[tuple[int, int], int] = {}
        self.v: dict[tuple[int, int], int] = {}
        for i, it in enumerate(problem.items):
            if it.movable:
                for s in range(it.stage + 1, it.need - 1):
                    self.w[i, s] = self.column(_TRIFLE * problem.link.d2h_seconds(it.nbytes) / scale)
                for s in range(it.stage + 2, it.need):
                    self.v[i, s] = self.column()
        self.z = [self.column(1.0 / scale, integer=False, upper=np.inf) for _ in range(steps)]
        d2h: list[dict[int, float]] = [{} for _ in range(steps)]
        h2d: list[dict[int, float]] = [{} for _ in range(steps)]
        memory: list[dict[int, float]] = [{} for _ in range(steps)]
        fixed = [float(problem.gradients(s)) for s in range(steps)]
        host: dict[int, float] = {}
        for i, it in enumerate(problem.items):
            outs = [(s, self.w[i, s]) for s in range(steps) if (i, s) in self.w]
            backs = [(s, self.v[i, s]) for s in range(steps) if (i, s) in self.v]
            if outs:
                self.row({c: 1.0 for _, c in outs}, -np.inf, 1.0)
                self.row({**{c: 1.0 for _, c in backs}, **{c: -1.0 for _, c in outs}}, 0.0, 0.0)
                for s, _ in backs:
                    terms = {c: 1.0 for t, c in backs if t <= s}
                    terms.update({c: -1.0 for t, c in outs if t < s})
                    self.row(terms, -np.inf, 0.0)
                stages = set(it.readers) | ({it.stage} if it.recomputable else set())
                for k in stages & self.r.keys():
                    self.row({**{c: 1.0 for _, c in outs}, self.r[k]: 1.0}, -np.inf, 1.0)
                for s, c in outs:
                    d2h[s][c] = problem.link.d2h_seconds(it.nbytes)
                    host[c] = float(it.nbytes)
                for s, c in backs:
                    h2d[s][c] = problem.link.h2d_seconds(it.nbytes)
            for s in range(it.stage, it.freed + 1):
                fixed[s] += it.nbytes
                if not it.until < s < it.need:
                    continue
                if it.recomputable and it.stage in self.r:
                    memory[s][self.r[it.stage]] = memory[s].get(self.r[it.stage], 0.0) - it.nbytes
                for t, c in outs:
                    if t < s:
                        memory[s][c] = -float(it.nbytes)
                for t, c in backs:
                    if t <= s:
                        memory[s][c] = float(it.nbytes)
        for s in range(steps):
            replay = {}
            if s >= n and 2 * n - 1 - s in self.r:
                k = 2 * n - 1 - s
                replay = {self.r[k]: -problem.chain.stages[k].forward_cost}
            for link in (d2h[s], h2d[s]):
                if link:
                    self.row({**link, self.z[s]: -1.0, **replay}, -np.inf, problem.compute(s))
            if memory[s] or fixed[s] > budget:
                self.row({c: b / budget for c, b in memory[s].items()}, -np.inf, 1.0 - fixed[s] / budget)
        if problem.host_budget is not None and host:
            self.row(host, -np.inf, float(problem.host_budget))

    def column(self, cost: float = 0.0, integer: bool = True, upper: float = 1.0) -> int:
        self.cost.append(cost)
        self.integer.append(int(integer))
        self.upper.append(upper)
        return len(self.cost) - 1

    def row(self, coefs: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append((coefs, lo, hi))

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
        for i in range(len(self.problem.items)):
            out = [s for (j, s), c in self.w.items() if j == i and x[c]]
            back = [s for (j, s), c in self.v.items() if j == i and x[c]]
            if out and back:
                moves.append(Move(i, out[0], back[0], out[0]))
        gap_found = float(getattr(result, "mip_gap", 0.0) or 0.0)
        return OffloadSchedule(recompute, tuple(moves)), gap_found, result.status


@register(
    "offload_milp",
    "three-way MILP (HiGHS): save, recompute or offload each saved tensor, transfers hidden in compute steps",
    (OffloadProblem,),
)
def solve(
    problem: OffloadProblem, budget_bytes: int, *, time_limit: float = 30.0, mip_rel_gap: float = 1e-4
) -> OffloadSolution:
    """The fastest three-way schedule of ``problem`` whose peak fits ``budget_bytes`` under NOTE
    [offload model], within ``time_limit`` seconds and ``mip_rel_gap``."""
    limit = budget_bytes
    for _ in range(3):
        schedule, gap, status = _Program(problem, limit).run(time_limit, mip_rel_gap)
        if schedule is None:
            infeasible = status == 2
            raise RematValueError(
                message(
                    "plan",
                    "no three-way plan fits the budget" if infeasible else "the MILP found no plan in time",
                    f"budget {budget_bytes} bytes, time_limit={time_limit} s",
                    "raise the budget or the host budget"
                    if infeasible
                    else "raise time_limit or use solver='offload_greedy'",
                )
            )
        verdict = "optimal" if status == 0 else "stopped at the time limit"
        note = f"HiGHS {verdict}, MIP gap {gap:.2e}"
        result = offload_solution(problem, schedule, "offload_milp", budget_bytes, gap, note)
        if result.predicted_peak_bytes <= budget_bytes:
            return result
        # HiGHS's feasibility tolerance let a schedule a few bytes over through: tighten and retry
        limit -= result.predicted_peak_bytes - budget_bytes + 1
    raise RematValueError(
        message(
            "plan",
            "the MILP kept returning plans over the budget",
            f"budget {budget_bytes}",
            "use solver='offload_greedy'",
        )
    )
