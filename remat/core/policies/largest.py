"""Largest first: evict the biggest storage (a baseline from the DTR paper)."""

from __future__ import annotations

from dataclasses import dataclass

from remat.core.policies.base import Greedy, argmin, candidates
from remat.core.policies.registry import register
from remat.core.residency import Residency


@dataclass(frozen=True)
class Largest(Greedy):
    name: str = "largest"
    needs: frozenset[str] = frozenset()

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        storages = candidates(runtime)
        return argmin(storages, -runtime.graph.nbytes_array[storages])


register(Largest())
