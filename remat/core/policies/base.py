"""What an eviction policy is, and the greedy search most policies share.

A policy is a small frozen dataclass answering three questions for the runtime: which storages to
evict to make room for ``nbytes`` (:meth:`EvictionPolicy.choose`), from which end of the pool an op's
outputs go (:meth:`EvictionPolicy.end`), and whether a mutated storage's new version may take over
the old memory (``inplace``). It declares the runtime state it reads in ``needs`` (``"layout"``: an
address pool; ``"classes"``: evicted equivalence classes; ``"regions"``: cached exact
neighbourhoods); the runtime tracks classes and regions on demand and refuses a policy that needs
addresses over a byte-counting pool.

Greedy policies evict the one storage of least score and let the runtime ask again until the
allocation fits. :func:`refine` finds that minimum without scoring every candidate exactly: a cheap
vectorized lower bound orders the candidates, and exact scores are computed only until the next
bound is no better than the best exact score so far. The result is the exact argmin.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np

from remat.core.pool import End
from remat.core.residency import Residency
from remat.trace.types import Op

TICK = 1e-9
"""Smallest staleness (seconds): a storage touched just now is very dear, not infinitely so."""


class EvictionPolicy(Protocol):
    """The questions the runtime asks a policy."""

    @property
    def name(self) -> str: ...

    @property
    def needs(self) -> frozenset[str]: ...

    @property
    def inplace(self) -> bool: ...

    def end(self, op: Op) -> End: ...

    def choose(self, runtime: Residency, nbytes: int) -> list[int]: ...


def candidates(runtime: Residency) -> np.ndarray:
    """The evictable storages, in increasing id (ties then go to the oldest)."""
    return np.flatnonzero(runtime.evictable.array[: len(runtime.graph)])


def staleness(runtime: Residency, storages: np.ndarray) -> np.ndarray:
    """Seconds of op time since each storage was last used, at least :data:`TICK`."""
    return np.maximum(runtime.clock - runtime.last.array[storages], TICK)


def lower_bound(runtime: Residency, storages: np.ndarray) -> np.ndarray:
    """Own cost plus the cost of the evicted direct neighbours: no more than c' by the exact
    neighbourhood or by equivalence classes (each neighbour's class holds at least its cost)."""
    return runtime.graph.cost_array[storages] + runtime.evicted_nearby.array[storages]


def refine(storages: np.ndarray, bound: np.ndarray, exact: Callable[[int, float], float]) -> list[int]:
    """The storage of least exact score, given ``bound <= exact`` elementwise. ``exact(s, best)``
    may stop early and return any value above ``best`` once it knows it cannot beat it."""
    if len(storages) == 0:
        return []
    order = np.argsort(bound, kind="stable")
    best, chosen = math.inf, int(storages[order[0]])
    for i in order:
        if bound[i] >= best:
            break
        storage = int(storages[i])
        score = exact(storage, best)
        if score < best:
            best, chosen = score, storage
    return [chosen]


def argmin(storages: np.ndarray, scores: np.ndarray) -> list[int]:
    """The storage of least score (the first one on ties)."""
    return [] if len(storages) == 0 else [int(storages[int(np.argmin(scores))])]


class Greedy:
    """Defaults of greedy policies: place everything from the low end, copy on write."""

    inplace = False

    def end(self, op: Op) -> End:
        return End.LOW
