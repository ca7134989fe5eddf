"""Optimal checkpointing of a heterogeneous chain: rotor's dynamic program over discretized memory.

Why a DP and not sqrt(n) segments: stages differ (a block with attention saves far more than a norm,
a matmul costs far more than an add), and the cheapest plan for a budget is a recursive choice of
where to keep checkpoints and which stages to run with grad, which equal segments cannot make. The
DP ranges over all persistent schedules (Beaumont et al., "Optimal checkpointing for heterogeneous
chains", 2019) under NOTE [chain model] and returns the cheapest whose peak fits.

NOTE [chain DP] ``opt[s, t][m]`` is the least compute that runs the backward of stages s..t, starting
with a_s alive (and d_t+1, unless t = n-1) and ending with d_s made and a_s freed, holding at most m
units of memory itself (a_s and d_t+1 included, what the caller holds not). Two choices:
- leaf: ``F_all s``, then stages s+1..t with a_s and x_s held, then ``B s``;
- checkpoint at s' (s < s' <= t): ``F_ck s``, ``F_n s+1 .. s'-1`` (making a_s'), then stages
  s'..t with a_s held, then stages s..s'-1 (whose d_s' the previous part made).
Each choice also needs its own steps' samples (NOTE [chain model]) to fit in m. Sizes are rounded
up to units of ``ceil(budget / slots)`` bytes; NOTE [chain DP gap] says how close to the true
optimum that leaves the plan, and the solver reports it. The same recursion with max/min instead of
+/min gives the smallest peak of any persistent schedule, exactly (no rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from remat._errors import RematValueError, message
from remat.planner.problem import Chain, ChainOp, ChainSchedule, ChainStep, Solution
from remat.planner.solvers.registry import below_minimum, register
from remat.planner.solvers.simulate import simulate, solution

__all__ = ["minimum_peak", "solve"]

LEAF = -1  # choice: run stage s with grad; any other choice is the checkpoint split s'


class _Sizes:
    """The chain's sizes in memory units, and the memory each step of a choice needs."""

    def __init__(self, chain: Chain, unit: int) -> None:
        self.n = len(chain)
        self.a = [-(-b // unit) for b in chain.activation_bytes]
        self.x = [-(-s.saved_bytes // unit) for s in chain.stages]

    def seed(self, t: int) -> int:
        """d_t+1, alive from the start of the sub-chain s..t (none for the last stage)."""
        return self.a[t + 1] if t < self.n - 1 else 0

    def leaf(self, s: int, t: int) -> int:
        """Samples of ``F_all s`` and ``B s`` in a leaf choice (a_s+1 is still alive at B s only when
        s = t; d_s is made unless s = 0)."""
        a, x = self.a, self.x
        backward = a[s] + x[s] + a[s + 1] + (a[s + 1] if s == t else 0) + (a[s] if s > 0 else 0)
        return max(a[s] + a[s + 1] + x[s] + self.seed(t), backward)

    def forward(self, s: int, j: int, t: int) -> int:
        """Sample of the forward of stage j (s <= j) while checkpointing at s for sub-chain s..t."""
        return self.a[s] * (j > s) + self.a[j] + self.a[j + 1] + self.seed(t)


def _emit(
    sizes: _Sizes, m: int, choose: Callable[[int, int, int], int], single_level: bool = False
) -> ChainSchedule:
    """The schedule the choices describe, from the whole chain with m units; with
    ``single_level``, a checkpointed segment's recomputation is all leaves."""
    steps: list[ChainStep] = []
    todo: list[tuple[int, int, int, bool] | ChainStep] = [(0, sizes.n - 1, m, False)]
    while todo:
        task = todo.pop()
        if isinstance(task, ChainStep):
            steps.append(task)
            continue
        s, t, m, leaves = task
        c = LEAF if leaves else choose(s, t, m)
        if c == LEAF:
            steps.append(ChainStep(ChainOp.F_ALL, s))
            todo.append(ChainStep(ChainOp.BACKWARD, s))
            if s < t:
                todo.append((s + 1, t, m - sizes.a[s] - sizes.x[s], leaves))
        else:
            steps.append(ChainStep(ChainOp.F_CHECK, s))
            steps += [ChainStep(ChainOp.F_NOGRAD, j) for j in range(s + 1, c)]
            todo += [(s, c - 1, m, single_level), (c, t, m - sizes.a[s], False)]  # popped last first
    return ChainSchedule(tuple(steps))


def minimum_peak(chain: Chain) -> tuple[int, ChainSchedule]:
    """The smallest peak (bytes) of any persistent schedule of ``chain``, and a schedule reaching it."""
    sizes = _Sizes(chain, 1)
    n = sizes.n
    best: dict[tuple[int, int], tuple[int, int]] = {}
    for length in range(n):
        for s in range(n - length):
            t = s + length
            options = [
                (
                    sizes.leaf(s, t)
                    if s == t
                    else max(sizes.leaf(s, t), sizes.a[s] + sizes.x[s] + best[s + 1, t][0]),
                    LEAF,
                )
            ]
            need = 0
            for split in range(s + 1, t + 1):
                need = max(need, sizes.forward(s, split - 1, t))
                options.append((max(need, sizes.a[s] + best[split, t][0], best[s, split - 1][0]), split))
            best[s, t] = min(options, key=lambda o: o[0])
    peak = best[0, n - 1][0]
    return peak, _emit(sizes, peak, lambda s, t, m: best[s, t][1])


@register(
    "chain",
    "optimal DP over a heterogeneous chain (rotor), with a proven gap for its discretization",
    (Chain,),
)
def solve(chain: Chain, budget_bytes: int, *, slots: int = 500, single_level: bool = False) -> Solution:
    """The cheapest persistent schedule of ``chain`` whose peak fits ``budget_bytes``, with memory
    discretized into about ``slots`` units (NOTE [chain DP]); O(n^3 slots) time, O(n^2 slots) memory.
    With ``single_level``, only plans plain checkpointing runs (each stage recomputed at most once:
    checkpointed segments recomputed all with grad) are considered.

    NOTE [chain DP gap] Rounding each size up overstates a peak by less than one unit per live
    value, and at most 2n + 3 values are alive at once; so every schedule that truly fits has a
    rounded peak within m_max + 2n + 3 units, and the table's cost there is a lower bound on the
    true optimum. The tables go that far; from the top down, the first table plan whose simulated
    peak truly fits is returned, and its distance to that bound is the reported gap (0 when every
    size is a multiple of the unit)."""
    minimum, fallback = minimum_peak(chain)
    if budget_bytes < minimum:
        raise below_minimum(budget_bytes, minimum, simulate(chain, fallback).peak_at)
    unit = max(1, math.ceil(budget_bytes / max(1, slots)))
    m_max = budget_bytes // unit
    sizes = _Sizes(chain, unit)
    exact = all(b % unit == 0 for b in chain.activation_bytes + tuple(s.saved_bytes for s in chain.stages))
    m_top = m_max if exact else m_max + 2 * sizes.n + 3
    opt, what = _tables(chain, sizes, m_top, single_level)
    final = opt[0, sizes.n - 1]
    bound = float(final[m_top])
    for m in range(m_top, m_max - 1, -1):  # the plan at m_max fits: its rounded peak does
        if not math.isfinite(final[m]):
            break
        schedule = _emit(sizes, m, lambda s, t, m: int(what[s, t][m]), single_level)
        if simulate(chain, schedule).peak_bytes <= budget_bytes:
            cost = float(final[m])
            gap = (cost - bound) / cost if cost > 0 else 0.0
            note = f"memory in units of {unit} bytes (sizes rounded up); the plan at {m} of {m_max} units"
            return solution(chain, schedule, "chain", budget_bytes, gap, note)
    if single_level:
        raise RematValueError(
            message(
                "plan",
                "no single-level plan fits the budget",
                f"budget {budget_bytes} bytes, in units of {unit} bytes",
                f"allow multi-level plans (they fit from {minimum} bytes) or raise the budget",
            )
        )
    note = (
        f"memory in units of {unit} bytes (sizes rounded up) left no plan within the budget; returned the "
        f"minimum-memory schedule ({minimum} bytes): pass more slots for a cheaper plan"
    )
    return solution(chain, fallback, "chain", budget_bytes, None, note)


def _tables(
    chain: Chain, sizes: _Sizes, m_max: int, single_level: bool
) -> tuple[dict[tuple[int, int], np.ndarray], dict[tuple[int, int], np.ndarray]]:
    """``opt`` and ``what`` of NOTE [chain DP], one array over m = 0..m_max per sub-chain; with
    ``single_level``, a checkpointed segment is recomputed all with grad (``leaves``)."""
    n = sizes.n
    f = [s.forward_cost for s in chain.stages]
    b = [s.backward_cost for s in chain.stages]
    m = np.arange(m_max + 1)
    inf = np.full(m_max + 1, np.inf)

    def held(table: np.ndarray, units: int) -> np.ndarray:
        """table[m - units]: the sub-chain's cost when the caller holds ``units``."""
        if units == 0:
            return table
        out = inf.copy()
        if units <= m_max:
            out[units:] = table[: m_max + 1 - units]
        return out

    def leaf(s: int, t: int, rest: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
        out = (
            np.full(m_max + 1, f[s] + b[s])
            if s == t
            else held(rest[s + 1, t], sizes.a[s] + sizes.x[s]) + f[s] + b[s]
        )
        out[m < sizes.leaf(s, t)] = np.inf
        return out

    opt: dict[tuple[int, int], np.ndarray] = {}
    what: dict[tuple[int, int], np.ndarray] = {}
    leaves: dict[tuple[int, int], np.ndarray] = {}
    segment = leaves if single_level else opt
    for length in range(n):
        for s in range(n - length):
            t = s + length
            best = leaf(s, t, opt)
            if single_level:
                leaves[s, t] = leaf(s, t, leaves)
            choice = np.full(m_max + 1, LEAF, dtype=np.int32)
            need, run = 0, 0.0
            for split in range(s + 1, t + 1):
                need = max(need, sizes.forward(s, split - 1, t))
                run += f[split - 1]
                candidate = held(opt[split, t], sizes.a[s]) + segment[s, split - 1] + run
                candidate[m < need] = np.inf
                better = candidate < best
                best[better] = candidate[better]
                choice[better] = split
            opt[s, t], what[s, t] = best, choice
    return opt, what
