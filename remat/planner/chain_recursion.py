"""Rotor's recursion over a chain: the memory each choice needs, and the smallest peak any plan has.

Why apart from the chain DP: the recursion of NOTE [chain DP] serves twice. With +/min over compute
it is the DP solver (``remat.planner.solvers.chain_dp``); with max/min over memory it gives the
smallest peak of any persistent schedule, exactly, which every solver's budget check
(``remat.planner.bounds``) and ``remat.plan``'s search for the lowest plan need without running a
solver. Both read the same sizes (``ChainSizes``, in memory units) and turn a table of choices into
a schedule the same way (``emit``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from remat.planner.types import Chain, ChainOp, ChainSchedule, ChainStep

__all__ = ["LEAF", "ChainSizes", "emit", "minimum_peak"]

LEAF = -1  # choice: run stage s with grad; any other choice is the checkpoint split s'


class ChainSizes:
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


def emit(
    sizes: ChainSizes, m: int, choose: Callable[[int, int, int], int], single_level: bool = False
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


@functools.lru_cache(maxsize=16)  # the planner asks again for each rung of a ladder
def minimum_peak(chain: Chain) -> tuple[int, ChainSchedule]:
    """The smallest peak (bytes) of any persistent schedule of ``chain``, and a schedule reaching it."""
    sizes = ChainSizes(chain, 1)
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
    return peak, emit(sizes, peak, lambda s, t, m: best[s, t][1])
