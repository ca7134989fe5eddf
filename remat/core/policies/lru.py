"""LRU: evict the storage used least recently (a baseline from the DTR paper)."""

from __future__ import annotations

from dataclasses import dataclass

from remat.core.policies.base import Greedy, argmin, candidates
from remat.core.policies.registry import register
from remat.core.residency import Residency


@dataclass(frozen=True)
class LRU(Greedy):
    name: str = "lru"
    needs: frozenset[str] = frozenset()

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        storages = candidates(runtime)
        return argmin(storages, runtime.last.array[storages])


register(LRU())
