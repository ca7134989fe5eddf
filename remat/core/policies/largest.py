"""Largest first: evict the biggest storage (a baseline from the DTR paper)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from remat.core.policies.base import Greedy, argmin, candidates
from remat.core.policies.registry import register

if TYPE_CHECKING:
    from remat.core.runtime import Runtime


@dataclass(frozen=True)
class Largest(Greedy):
    name: str = "largest"
    needs: frozenset[str] = frozenset()

    def choose(self, runtime: Runtime, nbytes: int) -> list[int]:
        storages = candidates(runtime)
        return argmin(storages, -runtime.graph.nbytes_array[storages])


register(Largest())
