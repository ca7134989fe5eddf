"""Equivalence classes of evicted storages: the DTR paper's cheap stand-in for the neighbourhood.

The exact evicted neighbourhood of a storage (every evicted storage joined to it through evicted
storages, :mod:`remat.core.neighbourhood`) can span thousands of storages. DTR approximates it with
union-find: an evicted storage joins the classes of its evicted neighbours, and a class carries the
sum of its members' costs. A restored storage subtracts its cost from its class but does not split
it (splitting union-find is expensive), which is where the approximation lies.

Each eviction creates a fresh union-find node, so a storage evicted twice does not drag along the
class it belonged to the first time.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.core.graph import Graph

_NONE = -1


class EvictedClasses:
    """Union-find over evicted storages, with the summed cost of each class."""

    def __init__(self) -> None:
        self._node: list[int] = []  # storage -> its current union-find node, or _NONE when resident
        self._parent: list[int] = []  # node -> parent node (itself for a root)
        self._value: list[float] = []  # root -> summed cost of the class

    def evicted(self, storage: int, graph: Graph, resident: Sequence[bool]) -> None:
        """``storage`` left memory: give it a class and merge with its evicted neighbours'."""
        while len(self._node) <= storage:
            self._node.append(_NONE)
        node = len(self._parent)
        self._parent.append(node)
        self._value.append(graph.cost[storage])
        self._node[storage] = node
        for neighbour in graph.neighbours(storage):
            if not resident[neighbour] and neighbour < len(self._node) and self._node[neighbour] != _NONE:
                node = self._union(node, self._node[neighbour])

    def restored(self, storage: int, graph: Graph) -> None:
        """``storage`` is back in memory: its cost leaves its class (the class stays whole)."""
        if storage < len(self._node) and self._node[storage] != _NONE:
            root = self._find(self._node[storage])
            self._value[root] -= graph.cost[storage]
            self._node[storage] = _NONE

    def neighbour_cost(self, storage: int, graph: Graph, resident: Sequence[bool]) -> float:
        """Summed cost of the distinct classes among the evicted neighbours of ``storage``."""
        roots = set()
        for neighbour in graph.neighbours(storage):
            if not resident[neighbour] and neighbour < len(self._node) and self._node[neighbour] != _NONE:
                roots.add(self._find(self._node[neighbour]))
        return sum(self._value[root] for root in roots)

    def _find(self, node: int) -> int:
        parent = self._parent
        root = node
        while parent[root] != root:
            root = parent[root]
        while parent[node] != root:
            parent[node], node = root, parent[node]
        return root

    def _union(self, a: int, b: int) -> int:
        a, b = self._find(a), self._find(b)
        if a == b:
            return a
        self._parent[a] = b
        self._value[b] += self._value[a]
        return b
