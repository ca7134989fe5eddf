"""What a budget is measured against: a trace's unconstrained peak, base compute, working set and
worst case.

The *unconstrained peak* is ``Trace.peak_bytes`` (``remat.trace.liveness``): no budget, constants
included, a storage freed when its last handle goes. A ratio budget is a fraction of it.

The *working set* is the most memory any single op needs at its first run under the runtime's own
rules (the constants it keeps, the op's inputs, its new outputs and its scratch), or the end of the
run, where everything the program keeps is resident at once (``Runtime.finish``). Below it nothing
can run to the end, but at it a restore may still run out: the *worst case*
(:func:`remat.core.worst_case.worst_case`) adds what restores can need, each op re-run whole and the
end's restores beside what is held firm, and each input of a gathering op held beside the restore
of another (NOTE [worst case]). At or above the worst case the runtime, counting bytes, never runs
out of memory and drops no lock, whatever it evicts, so no run loops for ever, though one may still
pass the thrash limit (the property tests check it on random programs); the simulator refuses
budgets below the working set and runs those between the two. Both depend on whether mutations
copy, so they are found by running the runtime itself with room for everything.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from remat._errors import RematTypeError, message
from remat.core.pool import BytePool, End
from remat.core.residency import Residency
from remat.core.worst_case import worst_case
from remat.sim.backend import run_trace
from remat.trace.types import Op, Trace


@dataclass(frozen=True)
class Facts:
    """Budget-independent figures of one trace under one mutation rule."""

    peak_bytes: int
    base_compute: float  # seconds: every op once
    working_set: int  # no budget below it can run
    worst_case: int  # at or above it, counting bytes never runs out and drops no lock (NOTE [worst case])
    ops: int


_CACHE: dict[tuple[int, bool], Facts] = {}


def facts(trace: Trace, inplace: bool) -> Facts:
    """The figures of ``trace`` when mutations do (``inplace``) or do not reuse memory. Cached for
    as long as ``trace`` lives."""
    if not isinstance(trace, Trace):
        raise RematTypeError(
            message(
                "sim.facts",
                "a trace is a remat.trace.Trace",
                f"got {type(trace).__name__}",
                "pass remat.trace.load's",
            )
        )
    key = (id(trace), inplace)
    found = _CACHE.get(key)
    if found is None:
        runtime = run_trace(trace, BytePool(2**62), _Unbounded(inplace))
        working_set = runtime.telemetry.working_set
        found = Facts(trace.peak_bytes, trace.total_cost, working_set, worst_case(runtime), len(trace.ops))
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
