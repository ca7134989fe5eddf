"""h_DTR = c' / (m · s) with the exact evicted neighbourhood (Kirisame et al., ICLR 2021).

c'(t) is t's own restore cost plus the cost of every evicted storage joined to t through evicted
storages (:mod:`remat.core.neighbourhood`); m its bytes; s the op time since its last use. The
neighbourhood is searched only for candidates whose own-cost bound could still win, and its sums are
cached between searches (NOTE [neighbourhood cache]).
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.core.policies.base import Greedy, candidates, lower_bound, refine, staleness
from remat.core.policies.registry import register
from remat.core.residency import Residency


@dataclass(frozen=True)
class DTR(Greedy):
    name: str = "dtr"
    needs: frozenset[str] = frozenset({"regions"})

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        storages = candidates(runtime)
        graph, resident, regions = runtime.graph, runtime.resident, runtime.regions
        assert regions is not None
        scale = graph.nbytes_array[storages] * staleness(runtime, storages)
        denominator = dict(zip(storages.tolist(), scale.tolist(), strict=True))

        def exact(storage: int, best: float) -> float:
            scale = denominator[storage]
            own = graph.cost[storage]
            return (own + regions.cost(storage, graph, resident, best * scale - own)) / scale

        return refine(storages, lower_bound(runtime, storages) / scale, exact)


register(DTR())
