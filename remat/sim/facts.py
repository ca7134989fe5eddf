"""What a budget is measured against: a trace's unconstrained peak, base compute and working set.

The *unconstrained peak* is ``Trace.peak_bytes`` (``remat.trace.liveness``): no budget, constants
included, a storage freed when its last handle goes. A ratio budget is a fraction of it.

The *working set* is the most memory any single op needs at its first run under the runtime's own
rules (the constants it keeps, the op's inputs and its new outputs), or the end of the run, where
everything the program keeps is resident at once (``Runtime.finish``). Below it nothing can run
to the end; at or above it the runtime does not run out of memory when counting bytes (NOTE
[relaxed locks] in :mod:`remat.core.runtime`; the property tests check it on random programs). It
depends on whether mutations copy, so it is found by running the runtime itself with room for
everything.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from remat.core.pool import BytePool, End
from remat.core.residency import Residency
from remat.sim.backend import run_trace
from remat.trace.types import Op, Trace


@dataclass(frozen=True)
class Facts:
    """Budget-independent figures of one trace under one mutation rule."""

    peak_bytes: int
    base_compute: float  # seconds: every op once
    working_set: int
    ops: int


_CACHE: dict[tuple[int, bool], Facts] = {}


def facts(trace: Trace, inplace: bool) -> Facts:
    """The figures of ``trace`` when mutations do (``inplace``) or do not reuse memory. Cached for
    as long as ``trace`` lives."""
    key = (id(trace), inplace)
    found = _CACHE.get(key)
    if found is None:
        runtime = run_trace(trace, BytePool(2**62), _Unbounded(inplace))
        found = Facts(trace.peak_bytes, trace.total_cost, runtime.telemetry.working_set, len(trace.ops))
        _CACHE[key] = found
        weakref.finalize(trace, _CACHE.pop, key, None)
    return found


@dataclass(frozen=True)
class _Unbounded:
    """The policy of a pool that never fills: it is never asked to choose."""

    inplace: bool
    name: str = "unbounded"
    needs: frozenset[str] = frozenset()

    def end(self, op: Op) -> End:
        return End.LOW

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        return []
