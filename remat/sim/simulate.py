"""``simulate``: run one trace under one budget and one eviction policy, and say what it cost.

The simulator is the rematerialization core (:mod:`remat.core`) with a backend that adds up recorded
op times, so its decisions are the ones an eager runtime would take. Memory is modelled either with
addresses (``layout=True``: an allocation needs one contiguous free block, so fragmentation counts)
or by counting bytes (``layout=False``: the model of the DTR paper's simulator). With a ``link``,
a victim whose copy to the host hides behind compute is swapped instead of evicted
(:mod:`remat.core.swap`), and the result counts the swaps, the host bytes and the stalls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from remat._errors import RematTypeError, RematValueError, message
from remat._units import format_bytes, parse_budget
from remat.core.driver import Thrashed, make_pool
from remat.core.policies.base import EvictionPolicy
from remat.core.policies.registry import resolve
from remat.core.pool import Fit, OutOfMemory
from remat.core.runtime import Runtime
from remat.core.swap import Swap, SwapCounts
from remat.host.link import Link
from remat.sim.backend import SimBackend, drive
from remat.sim.facts import Facts, facts
from remat.sim.result import Outcome, SimResult
from remat.trace.cost import Costs, costed
from remat.trace.types import Trace

_API = "sim.simulate"


def simulate(
    trace: Trace,
    budget: int | float | str,
    policy: str | EvictionPolicy = "dtr",
    thrash_limit: float = 2.0,
    *,
    layout: bool = True,
    fit: str = "best",
    compact: bool = False,
    link: Link | None = None,
) -> SimResult:
    """Run ``trace`` within ``budget`` (bytes, a size string such as ``"6GB"``, or a float ratio
    in (0, 1] of the unconstrained peak, constants included), evicting by ``policy`` (a registered
    name, see :func:`remat.core.policies.names`, or a policy object). A run whose overhead passes
    ``thrash_limit`` is stopped and reported as thrashed. ``fit`` is the address pool's placement,
    ``"best"`` or ``"first"``. ``compact``: the addresses model a layout the memory does not have,
    as for ``remat.dynamic``'s accounting backend (NOTE [model addresses] in
    ``remat.core.runtime``). A trace with no measured costs (taken on fake tensors) runs on the
    cost model's estimates, and the result says so (``SimResult.costs``). ``link``: swap victims
    to the host over this link where the copy hides behind compute (Capuchin); the overhead then
    counts the stalls for reloads beside the recomputations."""
    if not isinstance(trace, Trace):
        raise RematTypeError(
            message(
                _API,
                "trace must be a Trace",
                type(trace).__name__,
                "pass remat.trace.load(path) or a capture",
            )
        )
    _flags(layout=layout, compact=compact)
    chosen = _policy(policy, layout)
    _link(link)
    limit = _thrash_limit(thrash_limit)
    trace, costs = costed(trace)
    if not isinstance(fit, str) or fit not in {f.value for f in Fit}:
        raise RematValueError(message(_API, "unknown fit", f"got {fit!r}", "use 'best' or 'first'"))
    amount = parse_budget(budget, _API)
    known = facts(trace, chosen.inplace)
    nbytes = math.floor(amount * known.peak_bytes) if isinstance(amount, float) else amount
    if known.peak_bytes <= 0 and isinstance(amount, float):
        rule, todo = (
            "a ratio is of the trace's peak, and this trace holds no bytes",
            "simulate a step that makes tensors",
        )
        raise RematValueError(message(_API, rule, f"trace {trace.name or '(unnamed)'}, peak 0 bytes", todo))
    if nbytes <= 0:
        raise RematValueError(
            message(_API, "the budget comes to no bytes", f"{budget!r} of {known.peak_bytes}", "raise it")
        )
    if nbytes < known.working_set:  # no run can fit; between it and the worst case, some may
        reason = (
            f"the budget is below the working set ({format_bytes(known.working_set)}); "
            f"at {format_bytes(known.worst_case)} counting bytes never runs out of memory"
        )
        return _result(trace, chosen, layout, nbytes, known, costs, Outcome.OOM, reason=reason)
    pool = make_pool(nbytes, layout, fit)
    backend = SimBackend(known.base_compute, known.ops, limit)
    swap = Swap(link, backend) if link is not None else None
    runtime = Runtime(pool, chosen, backend, compact=compact, swap=swap)
    try:
        drive(runtime, trace, backend)
    except OutOfMemory as error:
        if error.needed > nbytes:
            needed = max(error.needed, known.worst_case)  # NOTE [worst case] in remat.core.worst_case
            reason = f"{error}; at {format_bytes(needed)} counting bytes never runs out of memory"
        else:  # enough bytes, but pinned pieces split them (address pools only)
            needed = known.worst_case
            reason = f"{error}: the free memory is fragmented by pinned pieces; try layout=False or 'coop'"
        return _result(
            trace, chosen, layout, nbytes, known, costs, Outcome.OOM, runtime, backend, reason, needed
        )
    except Thrashed:
        return _result(trace, chosen, layout, nbytes, known, costs, Outcome.THRASHED, runtime, backend)
    return _result(trace, chosen, layout, nbytes, known, costs, Outcome.OK, runtime, backend)


def sweep(
    traces: Sequence[Trace],
    policies: Sequence[str],
    ratios: Sequence[float],
    thrash_limit: float = 2.0,
    *,
    layout: bool = True,
    progress: Callable[[SimResult], None] | None = None,
    link: Link | None = None,
) -> list[SimResult]:
    """:func:`simulate` for every trace, policy and ratio, in that nesting order; ``policies`` may be
    one name."""
    if isinstance(policies, str):  # not its characters, one policy each
        policies = [policies]
    for what, one, value in (
        ("traces", "trace", traces),
        ("policies", "policy", policies),
        ("ratios", "ratio", ratios),
    ):
        if not isinstance(value, (list, tuple)):
            rule = f"{what} is a list (every {one} is swept)"
            raise RematTypeError(message(_API, rule, f"got {type(value).__name__}", f"pass [{one}, ...]"))
    _flags(layout=layout)
    for name in policies:
        _policy(name, layout)
    _link(link)
    results = []
    for trace in traces:
        for name in policies:
            for ratio in ratios:
                result = simulate(trace, float(ratio), name, thrash_limit, layout=layout, link=link)
                results.append(result)
                if progress is not None:
                    progress(result)
    return results


def _flags(**flags: object) -> None:
    for what, value in flags.items():
        if not isinstance(value, bool):
            raise RematTypeError(
                message(_API, f"{what} is True or False", f"got {value!r}", f"pass {what}=True")
            )


def _policy(policy: object, layout: bool) -> EvictionPolicy:
    return resolve(policy, layout, _API)


def _link(link: object) -> None:
    if link is not None and not isinstance(link, Link):
        raise RematTypeError(
            message(
                _API, "link must be a remat.Link or None", f"got {link!r}", 'pass remat.Link(d2h="25GB/s")'
            )
        )


def _thrash_limit(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RematTypeError(
            message(_API, "thrash_limit must be a number", f"got {value!r}", "pass e.g. 2.0")
        )
    if math.isnan(value) or value < 1.0:
        raise RematValueError(
            message(
                _API, "thrash_limit is an overhead and must be at least 1", f"got {value!r}", "pass e.g. 2.0"
            )
        )
    return float(value)


def _result(
    trace: Trace,
    policy: EvictionPolicy,
    layout: bool,
    budget: int,
    known: Facts,
    costs: Costs,
    outcome: Outcome,
    runtime: Runtime | None = None,
    backend: SimBackend | None = None,
    reason: str = "",
    needed: int | None = None,
) -> SimResult:
    telemetry = runtime.telemetry if runtime is not None else None
    swapped = runtime.swap.counts if runtime is not None and runtime.swap is not None else SwapCounts()
    if outcome is Outcome.OOM or backend is None:
        overhead = math.nan
    elif known.base_compute > 0:
        overhead = 1.0 + (backend.meter.recompute_cost + swapped.stall_seconds) / known.base_compute
    else:
        overhead = 1.0
    return SimResult(
        trace=trace.name,
        policy=policy.name,
        layout=layout,
        budget=budget,
        ratio=budget / known.peak_bytes if known.peak_bytes else math.inf,
        outcome=outcome,
        overhead=overhead,
        peak_bytes=telemetry.peak_bytes if telemetry else 0,
        unconstrained_peak=known.peak_bytes,
        needed_bytes=known.worst_case if needed is None else needed,
        evictions=telemetry.evictions if telemetry else 0,
        recomputations=telemetry.recomputations if telemetry else 0,
        fragmentation=telemetry.fragmentation if telemetry else 0.0,
        search_seconds=telemetry.search_seconds if telemetry else 0.0,
        searches=telemetry.searches if telemetry else 0,
        evicting_allocations=telemetry.evicting_allocations if telemetry else 0,
        tensors=len(trace.tensors),
        digest=backend.digest() if backend is not None and outcome is Outcome.OK else 0,
        reason=reason,
        costs=costs,
        link=str(runtime.swap.link) if runtime is not None and runtime.swap is not None else "",
        swaps=swapped.swaps,
        reloads=swapped.reloads,
        host_peak_bytes=swapped.host_peak,
        stall_seconds=swapped.stall_seconds,
    )
