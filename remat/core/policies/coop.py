"""Coop (OneFlow): eviction and allocation designed together, so that evicting makes contiguous room.

DTR evicts the cheapest storage, one at a time, wherever it lies; 60 MB freed here and 40 MB there do
not hold a 100 MB tensor, so it keeps evicting. Coop has three parts, each switchable for ablation:

1. Layout-aware eviction (``layout``). List the pool's pieces in address order; a free piece costs
   0, an evictable storage its DTR heuristic h = c'(t) / (m(t) s(t)), its cost density, with c' by
   equivalence classes, as DTE (``coop-exact``: by DTR's exact evicted neighbourhood); a locked or
   constant piece breaks the run. One two-pointer pass finds the contiguous run of pieces covering
   the request with the least summed h (the Coop paper's objective): O(n), where DTR's loop is
   O(n^2). Without it, Coop evicts greedily by h_DTR^eq. When no run holds the request and the
   runtime may pack the pool (an eager runtime whose addresses are a model), it evicts greedily by h.
2. Op-guided allocation (``op_guided``). Outputs of compute-dense ops (convolutions, matrix
   products, their gradients) go to the high end of the pool, the rest to the low end, so that
   cheap storages lie next to each other and a cheap window is easy to find.
3. Recomputable in-place (``inplace``). A mutated storage's new version takes over the old memory
   instead of a copy, so mutations do not scatter new storages over the pool.

NOTE [window score] Two other window scores are registered for comparison. ``coop-total`` sums
c'(t) / s(t) with no size term, as OneFlow's code scores a run: it frees just enough for each
request and evicts again at the next one. ``coop-per-byte`` divides a run's total by the bytes it
holds (free pieces included), for a run of one storage h_DTE. Summed h counts a run of k storages
of one cost density as k times that density, so it prefers one dear storage to several cheap ones
of the same bytes (ViT at 0.8: it evicts 147 MiB tensors of 2.65 ms each where DTE frees the room
from 36 MiB ones of 0.17 ms); the per-byte score does not, and loses fewer cells of the
simulator's sweep, but leaves ``remat.dynamic``'s small CNN test without a budget whose pool has
contiguous room (the parameters' new versions lie scattered). benchmarks/sim/README.md ("Where
Coop loses") compares the three.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from remat.core.policies.base import TICK, lower_bound
from remat.core.policies.dtr import DTR
from remat.core.policies.dtr_eq import choose_by_classes
from remat.core.policies.registry import register
from remat.core.pool import FREE, AddressPool, End
from remat.core.residency import Residency
from remat.trace.types import Op

_DENSE = re.compile(r"conv|matmul|linear|einsum|(?<![a-z])(?:add|b|baddb|addb)?mm(?![a-z])")


def compute_dense(name: str) -> bool:
    """True for ops whose cost per output byte is high: convolutions and matrix products, forward
    or backward (``cudnn_convolution_backward``, ``aten.addmm.default``, ``bmm``...)."""
    return _DENSE.search(name.lower()) is not None


_GREEDY = DTR()


@dataclass(frozen=True)
class Coop:
    name: str = "coop"
    layout: bool = True
    op_guided: bool = True
    inplace: bool = True
    score: str = "density"  # of a run: "density" (summed h), "total" (summed c'/s), "per-byte"
    exact: bool = False  # c' by the exact evicted neighbourhood (DTR's), or by equivalence classes

    @property
    def needs(self) -> frozenset[str]:
        near = "regions" if self.exact else "classes"
        return frozenset({near, "layout"}) if self.layout else frozenset({"classes"})

    def end(self, op: Op) -> End:
        return End.HIGH if self.op_guided and compute_dense(op.name) else End.LOW

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        if not self.layout:
            return choose_by_classes(runtime, adjacent_free=False)
        window = cheapest_window(runtime, nbytes, self.score, self.exact)
        if window or not getattr(runtime, "compact", False):
            return window
        # NOTE [model addresses] in remat/core/runtime.py: the pool's pieces can be packed, so any
        # victims make room once their bytes are free; with no window left, evict greedily by h.
        return _GREEDY.choose(runtime, nbytes) if self.exact else choose_by_classes(runtime, False)


def cheapest_window(
    runtime: Residency, nbytes: int, score: str = "density", exact: bool = False
) -> list[int]:
    """The storages of the least costly contiguous run of pieces holding ``nbytes``; [] if none.
    ``score``: a piece costs its h (``"density"``) or c'/s (``"total"``), and a run the sum of its
    pieces; ``"per-byte"``: the run of least c'/s per byte it holds, among the same candidates.

    Because costs are not negative, the best run ending at a given piece is the shortest one that
    holds ``nbytes``, so there is one candidate run per piece, found from the sizes alone (the two
    pointers, vectorized). Each run gets a lower bound of its cost from the pieces' own costs; exact
    costs (with the neighbourhood) are summed only for runs whose bound beats the best run so far."""
    pool = runtime.pool
    assert isinstance(pool, AddressPool)
    sizes, owners = pool.arrays()
    if len(sizes) == 0:
        return []
    graph, resident, classes, regions = runtime.graph, runtime.resident, runtime.classes, runtime.regions
    evictable = np.append(runtime.evictable.array[: len(graph)], False)
    real = np.where(owners >= 0, owners, len(graph))  # by-product blocks (negative owners) never move
    movable = evictable[real]
    free = owners == FREE
    barrier = ~(movable | free)
    own, staleness = np.zeros(len(sizes)), np.ones(len(sizes))
    staleness[movable] = np.maximum(runtime.clock - runtime.last.array[real[movable]], TICK)
    if score == "density":  # each piece's h_DTR = c' / (m s): the window sums cost densities
        staleness[movable] *= sizes[movable]
    own[movable] = lower_bound(runtime, real[movable]) / staleness[movable]
    # Run ending at piece r: pieces l..r, l the last index with sizes[l..r] >= nbytes, no barrier.
    bytes_to = np.concatenate(([0], np.cumsum(sizes)))
    cost_to = np.concatenate(([0.0], np.cumsum(own)))
    ends = np.arange(len(sizes))
    lefts = np.searchsorted(bytes_to, bytes_to[1:] - nbytes, side="right") - 1
    after_barrier = np.maximum.accumulate(np.where(barrier, ends + 1, 0))
    valid = (lefts >= 0) & (lefts >= after_barrier) & ~barrier
    lefts, ends = lefts[valid], ends[valid]
    if len(ends) == 0:
        return []
    per_byte = score == "per-byte"
    held = (bytes_to[ends + 1] - bytes_to[lefts]).astype(float) if per_byte else np.ones(len(ends))
    bounds = (cost_to[ends + 1] - cost_to[lefts]) / held
    known: dict[int, float] = {}

    def piece_cost(i: int) -> float:
        if i not in known:
            storage = int(owners[i])
            if not movable[i]:
                near = 0.0
            elif exact:
                assert regions is not None
                near = graph.cost[storage] + regions.cost(storage, graph, resident)
            else:
                assert classes is not None
                near = graph.cost[storage] + classes.neighbour_cost(storage, graph, resident)
            known[i] = near / staleness[i]
        return known[i]

    best, best_run = math.inf, (0, -1)
    for k in np.argsort(bounds, kind="stable"):
        if bounds[k] >= best:
            break
        left, right, scale = int(lefts[k]), int(ends[k]), float(held[k])
        total, stop = 0.0, best * scale
        for i in range(left, right + 1):
            total += piece_cost(i)
            if total >= stop:
                break
        if total < stop:
            best, best_run = total / scale, (left, right)
    return [int(owners[i]) for i in range(best_run[0], best_run[1] + 1) if owners[i] != FREE]


for _policy in (
    Coop(),
    Coop("coop-no-layout", layout=False),
    Coop("coop-no-opguided", op_guided=False),
    Coop("coop-no-inplace", inplace=False),
    Coop("coop-total", score="total"),
    Coop("coop-per-byte", score="per-byte"),
    Coop("coop-exact", exact=True),
):
    register(_policy)
