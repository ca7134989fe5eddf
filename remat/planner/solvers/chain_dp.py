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

import numpy as np

from remat._errors import RematValueError, message
from remat.planner.bounds import below_minimum
from remat.planner.chain_recursion import LEAF, ChainSizes, emit, minimum_peak
from remat.planner.cost_model import schedule_cost, solution
from remat.planner.solvers.registry import register
from remat.planner.types import Chain, Solution

__all__ = ["plans", "solve"]


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
    true optimum. The tables go that far; from the top down, the first table plan whose evaluated
    peak truly fits is returned, and its distance to that bound is the reported gap (0 when every
    size is a multiple of the unit)."""
    minimum, fallback = minimum_peak(chain)
    if budget_bytes < minimum:
        raise below_minimum(budget_bytes, minimum, schedule_cost(chain, fallback).peak_at)
    unit = max(1, math.ceil(budget_bytes / max(1, slots)))
    m_max = budget_bytes // unit
    sizes = ChainSizes(chain, unit)
    exact = all(b % unit == 0 for b in chain.activation_bytes + tuple(s.saved_bytes for s in chain.stages))
    m_top = m_max if exact else m_max + 2 * sizes.n + 3
    opt, what = _tables(chain, sizes, m_top, single_level)
    final = opt[0, sizes.n - 1]
    bound = float(final[m_top])
    for m in range(m_top, m_max - 1, -1):  # the plan at m_max fits: its rounded peak does
        if not math.isfinite(final[m]):
            break
        schedule = emit(sizes, m, lambda s, t, m: int(what[s, t][m]), single_level)
        peak = schedule_cost(chain, schedule).peak_bytes
        if peak <= budget_bytes:
            cost = float(final[m])
            gap = (cost - bound) / cost if cost > 0 else 0.0
            # the table row m may pass m_max (NOTE [chain DP gap]): rounded units are the DP's, the
            # user reads bytes of the chain model, where the plan fits
            note = _note(peak, budget_bytes, unit)
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


def plans(chain: Chain, budget_bytes: int, *, slots: int = 500, single_level: bool = False) -> list[Solution]:
    """Every plan one table of ``solve`` at ``budget_bytes`` holds: for each memory row m from the
    budget's down, the cheapest schedule whose rounded peak fits m units (NOTE [chain DP]), each
    distinct schedule once, most memory first, with its gap at m units' bytes. One DP for the
    plans at every budget up to ``budget_bytes``, in that budget's units (so coarser, relative to
    a small budget, than ``solve`` at that budget: the caller solves again lower for finer
    ones)."""
    if budget_bytes < minimum_peak(chain)[0]:
        return []
    unit = max(1, math.ceil(budget_bytes / max(1, slots)))
    sizes = ChainSizes(chain, unit)
    m_max = budget_bytes // unit
    m_top = m_max + 2 * sizes.n + 3  # rows above the budget's may hold plans that fit (NOTE [chain DP gap])
    opt, what = _tables(chain, sizes, m_top, single_level)
    final = opt[0, sizes.n - 1]
    out: list[Solution] = []
    for m in range(m_top, -1, -1):
        if not math.isfinite(final[m]):
            break
        if m > 0 and final[m - 1] == final[m]:
            continue  # the row below has a plan as cheap, and its peak is no higher
        schedule = emit(sizes, m, lambda s, t, m: int(what[s, t][m]), single_level)
        peak = schedule_cost(chain, schedule).peak_bytes
        if peak <= budget_bytes:
            room = min(m, m_max)  # the rows above the budget's hold plans checked against it
            limit = budget_bytes if m > m_max else m * unit
            note = _note(peak, limit, unit)
            # NOTE [chain DP gap]: no plan truly within ``room`` units costs less than row room + 2n + 3
            cost, bound = float(final[m]), float(final[room + 2 * sizes.n + 3])
            gap = (cost - bound) / cost if cost > 0 else 0.0
            out.append(solution(chain, schedule, "chain", limit, gap, note))
    return out


def _tables(
    chain: Chain, sizes: ChainSizes, m_max: int, single_level: bool
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


def _note(peak: int, limit: int, unit: int) -> str:
    """What a chain plan's notes say of its memory, in bytes of the chain model (what the DP
    solves on) and named as such: the step's peak, the plan's, is predicted on the whole trace."""
    return (
        f"chain DP schedule needing {peak} of the {limit} bytes it was solved for, in its chain "
        f"model (block outputs, their gradients and what each block saves, sizes rounded up to units of "
        f"{unit} bytes while solving; the plan's peak is the whole step's, predicted apart)"
    )
