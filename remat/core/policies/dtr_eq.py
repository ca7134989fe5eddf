"""h_DTR^eq = c' / (m · s) with c' approximated by equivalence classes of evicted storages.

The DTR paper's practical variant: the neighbourhood cost is the sum over the distinct classes of
t's evicted neighbours (:mod:`remat.core.classes`), O(degree) instead of a graph search.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.core.policies.base import Greedy, candidates, lower_bound, refine, staleness
from remat.core.policies.registry import register
from remat.core.pool import AddressPool
from remat.core.residency import Residency


@dataclass(frozen=True)
class DTREq(Greedy):
    name: str = "dtr-eq"
    needs: frozenset[str] = frozenset({"classes"})

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        return choose_by_classes(runtime, adjacent_free=False)


def choose_by_classes(runtime: Residency, adjacent_free: bool) -> list[int]:
    """argmin c'_eq / (m · s), where m counts the free bytes next to t when ``adjacent_free``
    (MegEngine's DTE)."""
    storages = candidates(runtime)
    graph, resident, classes = runtime.graph, runtime.resident, runtime.classes
    assert classes is not None
    size = graph.nbytes_array[storages]
    if adjacent_free:
        pool = runtime.pool
        assert isinstance(pool, AddressPool)
        size = size + pool.adjacent_free_all(len(graph))[storages]
    scale = size * staleness(runtime, storages)
    denominator = dict(zip(storages.tolist(), scale.tolist(), strict=True))

    def exact(storage: int, best: float) -> float:
        cost = graph.cost[storage] + classes.neighbour_cost(storage, graph, resident)
        return cost / denominator[storage]

    return refine(storages, lower_bound(runtime, storages) / scale, exact)


register(DTREq())
