"""The exact evicted neighbourhood e*(t) of the DTR heuristic, searched with an early stop and cached.

Evicting t makes every evicted storage that reaches t through evicted storages (its evicted
ancestors, which a restore of t must restore first) or that t reaches the same way (its evicted
descendants, whose restores will need t) dearer. DTR scores t with c'(t) = cost(t) + the cost of
that set. The set is found by two searches over evicted storages, one up the parents and one down
the children; they cannot meet because the graph is acyclic.

A search stops as soon as its sum passes ``limit``: a greedy policy only needs to know that t is not
better than the best candidate so far (:func:`remat.core.policies.base.refine`). In a backward pass
the evicted storages form one large region (dead gradients and activations) that many candidates
border, so the sums are cached between searches. NOTE [neighbourhood cache]: the sum found for t
stays a lower bound until a storage it counted is restored (a region only shrinks that way), and
stays exact until, in addition, a resident storage on its border is evicted or dies (a region only
grows that way). Each searched storage remembers which cached sums counted it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from remat.core.graph import Graph


class Neighbourhoods:
    """Cached neighbourhood costs of resident storages; the runtime reports every state change."""

    def __init__(self) -> None:
        self._sum: dict[int, float] = {}
        self._exact: dict[int, bool] = {}
        self._stamp: dict[int, int] = {}
        self._counted_by: dict[int, dict[int, int]] = {}  # storage -> {candidate: stamp}
        self._bordered_by: dict[int, dict[int, int]] = {}
        self._next = 0

    def cost(self, storage: int, graph: Graph, resident: Sequence[bool], limit: float = math.inf) -> float:
        """c'(storage) - cost(storage), exact when it is at most ``limit``; otherwise any value above
        ``limit``."""
        known = self._sum.get(storage)
        if known is not None and (self._exact[storage] or known > limit):
            return known
        return self._search(storage, graph, resident, limit)

    def created(self, storage: int, parents: Sequence[int]) -> None:
        """A new storage borders the cached sums of its parents (it may be evicted later)."""
        for parent in parents:
            stamp = self._stamp.get(parent)
            if stamp is not None and self._exact[parent]:
                self._bordered_by.setdefault(storage, {})[parent] = stamp

    def evicted(self, storage: int) -> None:
        """``storage`` left memory: sums it bordered may have grown; its own sum is void."""
        self._forget(storage)
        for candidate, stamp in self._bordered_by.pop(storage, {}).items():
            if self._stamp.get(candidate) == stamp:
                self._exact[candidate] = False

    def restored(self, storage: int) -> None:
        """``storage`` is back: sums that counted it may have shrunk."""
        for candidate, stamp in self._counted_by.pop(storage, {}).items():
            if self._stamp.get(candidate) == stamp:
                self._forget(candidate)

    def clear(self) -> None:
        """Forget every sum (the graph gained edges between existing storages)."""
        self.__init__()  # type: ignore[misc]

    def _forget(self, storage: int) -> None:
        if self._stamp.pop(storage, None) is not None:
            del self._sum[storage], self._exact[storage]

    def _search(self, storage: int, graph: Graph, resident: Sequence[bool], limit: float) -> float:
        stamp = self._next = self._next + 1
        cost = graph.cost
        counted = self._counted_by
        total = 0.0
        seen = {storage}
        border: list[int] = []
        complete = True
        for edges in (graph.parents, graph.children):
            stack = [storage]
            while stack and complete:
                for node in edges[stack.pop()]:
                    if node in seen:
                        continue
                    seen.add(node)
                    if resident[node]:
                        border.append(node)
                        continue
                    total += cost[node]
                    counted.setdefault(node, {})[storage] = stamp
                    stack.append(node)
                    if total > limit:
                        complete = False
                        break
        self._sum[storage], self._exact[storage], self._stamp[storage] = total, complete, stamp
        if complete:
            for node in border:
                self._bordered_by.setdefault(node, {})[storage] = stamp
        return total


def adjacent_cost(storage: int, graph: Graph, resident: Sequence[bool]) -> float:
    """Cost of the evicted direct neighbours of ``storage``: a lower bound of the neighbourhood."""
    cost = graph.cost
    return sum(cost[n] for n in set(graph.parents[storage] + graph.children[storage]) if not resident[n])
