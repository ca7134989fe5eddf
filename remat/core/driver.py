"""What every driver of the core shares: the pool a configuration asks for, the thrash rule, and
the recursion limit recomputation chains need.

The simulator (:mod:`remat.sim.backend`) and the eager runtime (:mod:`remat.dynamic`) both run
:class:`~remat.core.runtime.Runtime` over a pool, stop it once recomputation costs too much, and
let restores recurse once per evicted ancestor. Each of those rules is written here once.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from remat.core.pool import AddressPool, BytePool, Fit, Pool

TINY = 512
"""Blocks of at most this many bytes share segments (:mod:`remat.core.segments`) in pools of at
least :data:`SEGMENTS_FROM` bytes; smaller pools have none (in pools of a few MiB, segments cost the
dynamic runtime's tests of the arena backend more room than they saved)."""
SEGMENTS_FROM = 64 * 2**20


DEPTH = 200_000
"""Recursion limit while a runtime works: recomputation chains recurse once per evicted ancestor."""


def make_pool(capacity: int, layout: bool, fit: Fit | str = Fit.BEST) -> Pool:
    """The pool of ``capacity`` bytes a run asks for: addresses placed by ``fit`` (``layout``), tiny
    blocks in segments of their own, or counted bytes."""
    if not layout:
        return BytePool(capacity)
    return AddressPool(capacity, Fit(fit), TINY if capacity >= SEGMENTS_FROM else 0)


class Thrashed(Exception):
    """Recomputation passed the thrash limit."""


class ThrashMeter:
    """The thrash rule: a run has thrashed once its recomputations cost more than ``limit - 1``
    times its first runs; where the first runs cost nothing at all, count ops instead.

    The first runs are given up front (the simulator knows its whole trace) or added as they run
    (:meth:`first`, the eager runtime)."""

    def __init__(self, limit: float, base_cost: float = 0.0, base_ops: int = 0) -> None:
        self.limit = limit
        self.base_cost = base_cost  # first runs, at the cost the core counts
        self.base_ops = base_ops
        self.recompute_cost = 0.0  # recomputations, at the cost the core counts
        self.recompute_ops = 0

    def first(self, cost: float) -> None:
        """A first run of ``cost``."""
        self.base_cost += cost
        self.base_ops += 1

    def recomputed(self, cost: float) -> None:
        """A recomputation of ``cost``; raises :class:`Thrashed` past the limit."""
        self.recompute_cost += cost
        self.recompute_ops += 1
        extra = self.limit - 1.0
        if math.isinf(extra):
            return
        if self.base_cost > 0:
            over = self.recompute_cost > extra * self.base_cost
        else:
            over = self.recompute_ops > extra * self.base_ops
        if over:
            raise Thrashed

    def allowance(self) -> None:
        """Start counting recomputations again (a new allowance against the same first runs)."""
        self.recompute_cost = 0.0
        self.recompute_ops = 0


@contextmanager
def deep_recursion() -> Iterator[None]:
    """Raise the recursion limit to at least :data:`DEPTH` for the block."""
    previous = deepen()
    try:
        yield
    finally:
        sys.setrecursionlimit(previous)


def deepen() -> int:
    """Raise the recursion limit to at least :data:`DEPTH`; returns the limit before, to restore."""
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(max(previous, DEPTH))
    return previous
