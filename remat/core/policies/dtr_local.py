"""h_DTR^local = c / (m · s): own cost only, no neighbourhood (the DTR paper's cheapest variant)."""

from __future__ import annotations

from dataclasses import dataclass

from remat.core.policies.base import Greedy, argmin, candidates, staleness
from remat.core.policies.registry import register
from remat.core.residency import Residency


@dataclass(frozen=True)
class DTRLocal(Greedy):
    name: str = "dtr-local"
    needs: frozenset[str] = frozenset()

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        storages = candidates(runtime)
        graph = runtime.graph
        scores = graph.cost_array[storages] / (graph.nbytes_array[storages] * staleness(runtime, storages))
        return argmin(storages, scores)


register(DTRLocal())
