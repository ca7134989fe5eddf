"""Checkmate's MILP on a Dag: the optimal recomputation plan for a DAG at a byte budget.

Why an MILP where a chain has a DP: a DAG with skip connections (U-Net, DenseNet, attention's
residuals) has no stage order to recurse on, and Checkmate (Jain et al., 2020) shows the exact
problem is a compact integer program that a good solver handles for graphs of tens to a few hundred
nodes. This one is solved by HiGHS through ``scipy.optimize.milp`` with a time limit; the reported
gap is HiGHS's MIP gap. Larger graphs are coarsened first (``coarsen``), so the plan is optimal for
the coarsened DAG.

NOTE [DAG MILP] Stages t = 0..T-1 (T = n forward stages + one per backward step), as in NOTE
[DAG model]. Binaries R[t,i] (compute node i in stage t; R[t,t] = 1 for t < n, no node after t in a
forward stage), S[t,i] (node i in memory at the start of stage t), FREE[t,i,k] (free i right after
computing k in stage t). Rows:
- deps: R[t,k] <= R[t,d] + S[t,d]; a backward step's reads: R[t,r] + S[t,r] >= 1;
- keep: S[t+1,i] <= S[t,i] + R[t,i]; no recomputing a live value: R[t,i] + S[t,i] <= 1;
- FREE[t,i,k] = 1 exactly when R[t,k] = 1, S[t+1,i] = 0 and no later consumer of i is computed in t
  (Checkmate's linearization with a hazard count h: FREE + h >= 1 and kappa FREE + h <= kappa); a
  value the stage's backward step reads is not freed before it;
- memory: U[t,0] = live_bytes(t) + sum_i S[t,i] m_i + R[t,0] m_0,
  U[t,k] = U[t,k-1] - sum_i m_i FREE[t,i,k-1] + R[t,k] m_k, and U[t,k] <= budget.
The samples U[t,k] are exactly the cost model's (a U[t,k] with k not computed equals the memory just
before the next sample), so the MILP's peak is the cost model's peak. Objective: total compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from remat._errors import RematValueError, message
from remat.planner.bounds import below_minimum, lower_bound
from remat.planner.cost_model import schedule_cost, solution
from remat.planner.lowering import coarsen
from remat.planner.solvers.registry import register
from remat.planner.types import Dag, DagSchedule, DagStage, Solution

__all__ = ["solve"]

Linear = tuple[dict[int, float], float]  # {column: coefficient}, constant


@dataclass
class _Model:
    """The MILP of NOTE [DAG MILP] for one DAG, as columns and rows for ``scipy.optimize.milp``.
    R[t,i] and S[t,i] exist only where node i can still be of use (it or a descendant is computed
    or read at stage t or later); elsewhere they are 0, and R[t,t] of a forward stage is 1."""

    dag: Dag
    cost: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)
    r: dict[tuple[int, int], int] = field(default_factory=dict)
    s: dict[tuple[int, int], int] = field(default_factory=dict)
    u: list[int] = field(default_factory=list)

    def column(self, cost: float = 0.0, integer: bool = True, upper: float = 1.0) -> int:
        self.cost.append(cost)
        self.integer.append(int(integer))
        self.upper.append(upper)
        return len(self.cost) - 1

    def row(self, terms: Linear, lo: float, hi: float) -> None:
        coefs, const = terms
        if coefs:
            self.rows.append((coefs, lo - const, hi - const))

    def computed(self, t: int, i: int) -> Linear:
        if (t, i) in self.r:
            return {self.r[t, i]: 1.0}, 0.0
        return {}, float(t == i)

    def held(self, t: int, i: int) -> Linear:
        return ({self.s[t, i]: 1.0}, 0.0) if (t, i) in self.s else ({}, 0.0)

    def build(self, scale: float) -> None:
        """Columns and rows, bytes divided by ``scale``; R's cost is the node's compute."""
        g, n = self.dag, len(self.dag.nodes)
        stages = n + len(g.backward)
        ancestors: list[set[int]] = []
        for i, node in enumerate(g.nodes):
            ancestors.append({i}.union(*(ancestors[d] for d in node.deps)))
        useful: list[set[int]] = [set() for _ in range(stages + 1)]  # of use at stage t or later
        for t in reversed(range(stages)):
            targets = [t] if t < n else g.backward[t - n].reads
            useful[t] = useful[t + 1].union(*(ancestors[i] for i in targets))
        base = g.base_cost or 1.0
        for t in range(stages):
            for i in sorted(useful[t]):
                if i < t or (t >= n and i < n):
                    self.r[t, i] = self.column(g.nodes[i].cost / base)
                if i < min(t, n):
                    self.s[t, i] = self.column()
        for t in range(stages):
            reads = set(g.backward[t - n].reads) if t >= n else set()
            span = t + 1 if t < n else n
            for k in range(span):
                for d in set(g.nodes[k].deps):
                    self.row(
                        _sum(self.computed(t, k), self.computed(t, d), self.held(t, d), signs=(1, -1, -1)),
                        -np.inf,
                        0,
                    )
            for i in reads:
                self.row(_sum(self.computed(t, i), self.held(t, i)), 1, np.inf)
            for i in range(span):
                if t + 1 < stages:
                    self.row(
                        _sum(self.held(t + 1, i), self.held(t, i), self.computed(t, i), signs=(1, -1, -1)),
                        -np.inf,
                        0,
                    )
                if (t, i) in self.s and (t, i) in self.r:
                    self.row(_sum(self.computed(t, i), self.held(t, i)), -np.inf, 1)
            for i in range(span):  # a value is held or computed only to be used (dominance cuts)
                if i in reads or i == t:
                    continue
                uses = [self.computed(t, j) for j in g.users[i] if (t, j) in self.r or j == t]
                later = [self.held(t + 1, i)] if (t + 1, i) in self.s else []
                for own in (self.held(t, i), self.computed(t, i)):
                    self.row(
                        _sum(own, *uses, *later, signs=(1,) + (-1,) * (len(uses) + len(later))), -np.inf, 0
                    )
            self._memory(t, span, reads, scale)

    def _memory(self, t: int, span: int, reads: set[int], scale: float) -> None:
        """U rows of stage t: one sample per node that may be computed, and one at the backward step."""
        g, n = self.dag, len(self.dag.nodes)
        live = g.backward[t - n].live_bytes if t >= n else 0
        state: Linear = ({}, live / scale)
        for i in range(span):
            state = _sum(state, self.held(t, i), weights=(1.0, g.nodes[i].bytes / scale))
        samples = [k for k in range(span) if (t, k) in self.r or k == t] + ([span] if t >= n else [])
        for k in samples:  # k = span: the backward step's sample
            if k < span:
                state = _sum(state, self.computed(t, k), weights=(1.0, g.nodes[k].bytes / scale))
            col = self.column(integer=False, upper=np.inf)
            self.u.append(col)
            self.row(_sum(({col: 1.0}, 0.0), state, signs=(1, -1)), 0, 0)
            state = ({col: 1.0}, 0.0)
            for i in ({k, *g.nodes[k].deps} - reads) if k < span else ():
                consumers = [j for j in g.users[i] if k < j < span]
                if t in consumers:
                    continue  # forward node t reads i later in its own stage: never freed here
                later = [self.computed(t, j) for j in consumers if (t, j) in self.r]
                keep = [self.held(t + 1, i)] if (t + 1, i) in self.s else []
                hazard = _sum(
                    ({}, 1.0),
                    self.computed(t, k),
                    *keep,
                    *later,
                    signs=(1, -1) + (1,) * (len(keep) + len(later)),
                )
                kappa = 1 + len(keep) + len(later)  # the most hazards there can be
                free = self.column()
                self.row(_sum(({free: 1.0}, 0.0), hazard), 1, np.inf)
                self.row(_sum(({free: float(kappa)}, 0.0), hazard), -np.inf, kappa)
                state = _sum(state, ({free: 1.0}, 0.0), weights=(1.0, -g.nodes[i].bytes / scale))

    def run(
        self, limit: float | None, time_limit: float, gap: float
    ) -> tuple[DagSchedule | None, float, int, float]:
        """Solve with U <= ``limit`` (scaled), or minimizing the peak when ``limit`` is None.
        Returns the schedule (None when none was found), the MIP gap, scipy's status and the
        objective's dual bound."""
        cost, upper = list(self.cost), list(self.upper)
        rows = list(self.rows)
        if limit is None:
            peak = len(cost)
            cost = [0.0] * len(cost) + [1.0]
            upper.append(np.inf)
            rows += [({u: 1.0, peak: -1.0}, -np.inf, 0.0) for u in self.u]
        else:
            for u in self.u:
                upper[u] = limit
        # scipy (HiGHS) loads when a MILP is solved, not when remat is imported: it takes seconds
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        data = [(i, c, v) for i, (coefs, _, _) in enumerate(rows) for c, v in coefs.items()]
        matrix = coo_matrix(
            ([v for _, _, v in data], ([i for i, _, _ in data], [c for _, c, _ in data])),
            shape=(len(rows), len(cost)),
        )
        integer = self.integer + ([0] if limit is None else [])
        result = milp(
            np.array(cost),
            integrality=np.array(integer),
            bounds=Bounds(np.zeros(len(cost)), np.array(upper)),
            constraints=LinearConstraint(
                matrix.tocsr(), [lo for _, lo, _ in rows], [hi for _, _, hi in rows]
            ),
            options={"time_limit": time_limit, "mip_rel_gap": gap, "disp": False},
        )
        bound = float(getattr(result, "mip_dual_bound", 0.0) or 0.0)
        if result.x is None:
            return None, float("nan"), result.status, bound
        x = np.round(result.x).astype(int)
        return self._schedule(x), float(getattr(result, "mip_gap", 0.0) or 0.0), result.status, bound

    def _schedule(self, x: np.ndarray) -> DagSchedule:
        n, stages = len(self.dag.nodes), len(self.dag.nodes) + len(self.dag.backward)
        out = []
        for t in range(stages):
            compute = tuple(
                i for i in range(min(t + 1, n)) if i == t or ((t, i) in self.r and x[self.r[t, i]])
            )
            alive = {i for i in range(n) if (t, i) in self.s and x[self.s[t, i]]} | set(compute)
            kept = {i for i in range(n) if (t + 1, i) in self.s and x[self.s[t + 1, i]]}
            out.append(DagStage(compute, tuple(sorted(alive - kept))))
        return DagSchedule(tuple(out))


def _sum(
    *terms: Linear, signs: tuple[int, ...] | None = None, weights: tuple[float, ...] | None = None
) -> Linear:
    """A weighted sum of linear expressions."""
    factors = weights if weights is not None else signs if signs is not None else (1,) * len(terms)
    coefs: dict[int, float] = {}
    const = 0.0
    for (c, k), w in zip(terms, factors, strict=True):
        for col, v in c.items():
            coefs[col] = coefs.get(col, 0.0) + w * v
        const += w * k
    return coefs, const


@register("milp", "Checkmate MILP on a DAG (HiGHS), optimal up to its reported gap", (Dag,))
def solve(
    dag: Dag,
    budget_bytes: int,
    *,
    time_limit: float = 60.0,
    mip_rel_gap: float = 1e-4,
    max_nodes: int = 20,
) -> Solution:
    """The cheapest schedule of ``dag`` (coarsened to ``max_nodes`` first) whose peak fits
    ``budget_bytes``, within ``time_limit`` seconds and ``mip_rel_gap`` (see NOTE [DAG MILP])."""
    notes = []
    coarsened = len(dag.nodes) > max_nodes
    if coarsened:
        size = len(dag.nodes)
        dag = coarsen(dag, max_nodes)
        notes.append(f"coarsened from {size} to {len(dag.nodes)} nodes; decisions are per block")
    model = _Model(dag)
    model.build(float(budget_bytes))
    if budget_bytes < lower_bound(dag)[0]:
        raise _infeasible(model, dag, budget_bytes, time_limit, coarsened)  # skip the slow proof
    limit = float(budget_bytes)
    for _ in range(3):
        schedule, gap, status, _ = model.run(limit / budget_bytes, time_limit, mip_rel_gap)
        if schedule is None:
            if status == 2:
                raise _infeasible(model, dag, budget_bytes, time_limit, coarsened)
            raise RematValueError(
                message(
                    "plan",
                    "the MILP found no plan within its time limit",
                    f"time_limit={time_limit} s, {len(dag.nodes)} nodes",
                    "raise time_limit, lower max_nodes, or use solver='greedy'",
                )
            )
        verdict = "optimal" if status == 0 else "stopped at the time limit"
        notes.append(f"HiGHS {verdict}, MIP gap {gap:.2e}")
        result = solution(dag, schedule, "milp", budget_bytes, gap, "; ".join(notes))
        if result.predicted_peak_bytes <= budget_bytes:
            return result
        # HiGHS's feasibility tolerance let a schedule a few bytes over through: tighten and retry
        limit -= result.predicted_peak_bytes - budget_bytes + 1
        notes.pop()
    raise RematValueError(
        message(
            "plan",
            "the MILP kept returning plans over the budget",
            f"budget {budget_bytes}",
            "use solver='greedy'",
        )
    )


def _infeasible(model: _Model, dag: Dag, budget: int, time_limit: float, coarsened: bool) -> RematValueError:
    """The error for a budget the DAG cannot fit, with its smallest peak: exact when the
    peak-minimizing MILP solves, else a bound. A coarsened DAG's minimum is not the step's (its
    blocks are all-or-nothing), so that error says to coarsen less instead."""
    schedule, _, status, bound = model.run(None, time_limit, 0.0)
    if schedule is not None and status == 0:
        cost = schedule_cost(dag, schedule)
        minimum, where, exact = cost.peak_bytes, cost.peak_at, True
    else:
        minimum, where = lower_bound(dag)
        minimum, exact = max(minimum, int(np.ceil(bound * budget - 1e-6))), False
    if not coarsened:
        return below_minimum(budget, minimum, where, exact)
    return RematValueError(
        message(
            "plan",
            f"the DAG coarsened to {len(dag.nodes)} blocks cannot fit the budget",
            f"budget {budget} < {minimum} bytes{'' if exact else ' at least'}, needed by {where}",
            "pass a larger max_nodes (finer blocks) or use solver='greedy'",
        )
    )
