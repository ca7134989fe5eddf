"""The worst case of a program (NOTE [worst case] in remat.core.worst_case): on hand-written ones,
and on random ones against a plain recursion."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

from never_evicts import NeverEvicts

from remat.core.policies import get
from remat.core.pool import BytePool, OutOfMemory
from remat.core.residency import Residency
from remat.core.runtime import Runtime
from remat.core.worst_case import worst_case
from remat.sim import Outcome, facts, simulate
from remat.sim.backend import SimBackend, drive, run_trace
from remat.sim.synthetic import Builder, random_program
from remat.trace.types import Op, Trace


def kept_with_a_by_product() -> Trace:
    """The NOTE's program: ``c``'s op also makes a 72 B by-product, and ``a``, ``b``, ``c`` are kept."""
    p = Builder()
    x, y = p.tensor(18, constant=True), p.tensor(57, constant=True)
    dropped, read = p.tensor(27), p.tensor(93)
    p.op("two", (y, x), (dropped, read), 1.0)
    p.release(dropped)
    a = p.tensor(70)
    p.op("a", (y, x, read), (a,), 1.0)
    p.release(read)
    b = p.tensor(58)
    p.op("b", (x, y, a), (b,), 1.0)
    by_product, c = p.tensor(72), p.tensor(31)
    p.op("c", (y,), (by_product, c), 1.0)
    p.release(by_product)
    return p.trace("kept")


def test_restoring_at_the_end_beside_the_firm_storages_is_counted() -> None:
    trace = kept_with_a_by_product()
    known = facts(trace, inplace=False)
    assert (known.working_set, known.worst_case) == (238, 75 + 70 + 58 + 72 + 31)
    backend = SimBackend(known.base_compute, known.ops, 10.0)
    runtime = Runtime(BytePool(known.worst_case), get("lru"), backend)
    drive(runtime, trace, backend)
    assert runtime.telemetry.peak_bytes <= known.worst_case
    backend = SimBackend(known.base_compute, known.ops, 10.0)
    try:
        drive(Runtime(BytePool(known.worst_case - 1), get("lru"), backend), trace, backend)
    except OutOfMemory as error:
        assert error.needed == known.worst_case  # the end's last restore, beside a and b
    else:
        raise AssertionError("the run one byte below the worst case did not run out of memory")


def test_scratch_counts_at_the_first_run_and_in_restores() -> None:
    p = Builder()
    x = p.tensor(10, constant=True)
    first, scratchy = p.tensor(20), p.tensor(20)
    p.op("first", (x,), (first,), 1.0)
    p.op("scratchy", (x,), (scratchy,), 1.0)
    plain = p.trace("scratch")
    events = tuple(
        replace(e, scratch=30) if isinstance(e, Op) and e.name == "scratchy" else e for e in plain.events
    )
    trace = replace(plain, events=events)
    known = facts(trace, inplace=False)
    assert known.working_set == 10 + 20 + 30  # the first run of scratchy, its scratch beside it
    assert known.worst_case == 10 + 20 + 20 + 30  # restoring scratchy at the end, first held firm
    assert simulate(trace, known.worst_case, "lru", layout=False).outcome is Outcome.OK
    short = simulate(trace, known.working_set - 1, "lru", layout=False)
    assert short.outcome is Outcome.OOM and "below the working set" in short.reason


def by_recursion(state: Residency) -> int:
    """The NOTE's figure the direct way: each need found by recursion, without the walk's table,
    and each kept storage's chain on its own."""
    graph = state.graph
    nbytes, constant = graph.nbytes, graph.constant
    count = len(graph)
    restorable = [not constant[s] and nbytes[s] > 0 for s in range(count)]
    made = [0] * count
    for record in graph.records:
        for output in record.outputs:
            made[output] = sum(nbytes[o] for o in record.outputs) + record.op.scratch
    constants = sum(n for n, fixed in zip(nbytes, constant, strict=True) if fixed)

    def gather(inputs: list[int], firm: frozenset[int]) -> int:
        held = [p for p in inputs if restorable[p] and p not in firm]
        total = sum(nbytes[p] for p in held)
        return max([total] + [total - nbytes[p] + need(p, firm) for p in held])

    @functools.cache
    def need(s: int, firm: frozenset[int]) -> int:
        held = [p for p in graph.parents[s] if restorable[p] and p not in firm]
        return max(gather(held, firm), sum(nbytes[p] for p in held) + made[s])

    worst = state.telemetry.working_set
    for s in range(count):
        if restorable[s]:
            worst = max(worst, constants + need(s, frozenset()))
    for record in graph.records:
        worst = max(worst, constants + gather(list(record.inputs), frozenset()))
    firm: frozenset[int] = frozenset()
    for storage in (s for s in range(count) if state.live[s] > 0 and restorable[s]):
        worst = max(worst, constants + sum(nbytes[f] for f in firm) + need(storage, firm))
        firm |= {storage}
    return min(worst, state.telemetry.peak_bytes)


def test_the_walk_finds_what_a_recursion_finds() -> None:
    beyond = 0  # programs whose worst case is above their working set
    for seed in range(200):
        sizes = random.Random(seed)
        trace = random_program(random.Random(seed), sizes.randint(1, 30), sizes.randint(1, 3))
        for inplace in (False, True):
            state = run_trace(trace, BytePool(2**62), NeverEvicts(inplace))
            assert worst_case(state) == by_recursion(state), (seed, inplace)
            beyond += by_recursion(state) > facts(trace, inplace).working_set
    assert beyond > 0
