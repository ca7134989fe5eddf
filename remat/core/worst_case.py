"""The worst case of a program under the runtime: the most bytes it can need at once, whatever was
evicted before, so the least budget at which counting bytes never runs out of memory (it may still thrash).

NOTE [worst case] The working set (``Telemetry.working_set``: the most bytes an op needs at its
first run, or the end, where everything the program keeps is resident at once) is what no budget
can go below; it is not enough. With relaxed locks (NOTE [relaxed locks] in
:mod:`remat.core.runtime`) a restore deep in a recomputation needs only its own op's inputs and
outputs beside the constants, but two things need more:

- A restore re-runs its producer whole: every output gets memory again (a by-product as a
  transient block), the gathered inputs include the inputs of the views re-derived with it, and
  the constants are those of the moment of the restore, not of the first run.
- :meth:`~remat.core.runtime.Runtime.finish` holds what the program keeps firm, in the order the
  storages were made, and firm locks are never relaxed: restoring a kept storage that was evicted
  re-runs its chain beside every kept storage made before it. A random program (seed 54 of
  ``tests/sim``'s regressions) keeps ``a`` (70 B), ``b`` (58 B) and ``c`` (31 B), where ``c``'s op
  also makes a 72 B by-product: with 75 B of constants its working set is 238 B, but restoring
  ``c`` at the end beside ``a`` and ``b`` needs 75 + 70 + 58 + 72 + 31 = 306 B.

:func:`worst_case` adds both: every restore's op with the final constants, and each kept storage's
restore chain (every ancestor that is neither a constant nor held firm taken as evicted) beside
the kept storages before it, in time linear in the graph's edges.

At the worst case the runtime does not run out of memory; it may still thrash (two inputs of an op
whose restore chains evict each other), which the thrash limit stops."""

from __future__ import annotations

from remat.core.residency import Residency


def worst_case(state: Residency) -> int:
    """The worst case (NOTE [worst case]) of the program ``state`` has run to its end."""
    graph = state.graph
    nbytes, constant, parents = graph.nbytes, graph.constant, graph.parents
    count = len(graph)
    constants = sum(n for n, fixed in zip(nbytes, constant, strict=True) if fixed)  # never evicted
    # Only these can be evicted and restored (an empty storage stays resident).
    restorable = [not constant[s] and nbytes[s] > 0 for s in range(count)]
    sources = [[p for p in parents[s] if restorable[p]] for s in range(count)]
    made = [0] * count  # bytes the producer's run allocates: every output, and its scratch
    for record in graph.records:
        allocated = sum(nbytes[o] for o in record.outputs) + record.op.scratch
        for output in record.outputs:
            made[output] = allocated
    own = [sum(nbytes[p] for p in sources[s]) + made[s] if restorable[s] else 0 for s in range(count)]
    kept = [s for s in range(count) if state.live[s] > 0 and restorable[s]]
    worst = max([state.telemetry.working_set] + [constants + need for need in own])
    # ``finish`` restores the kept storages in order, each beside those before it held firm. A
    # storage's need (its non-firm sources, its run) plus the firm bytes only grows with the firm
    # set, so each storage scores highest in the last restore chain that reaches it: walking the
    # chains last first, one walk stops at what a later one saw, and every edge is crossed once.
    order = {storage: k for k, storage in enumerate(kept)}
    firm_bytes = [0]
    for storage in kept:
        firm_bytes.append(firm_bytes[-1] + nbytes[storage])
    seen: set[int] = set()
    for k in range(len(kept) - 1, -1, -1):
        chain, stack = 0, [kept[k]]
        seen.add(kept[k])  # held firm by every later chain, so no later walk reached it
        while stack:
            s = stack.pop()
            held = [p for p in sources[s] if order.get(p, k) >= k]  # not yet firm
            chain = max(chain, sum(nbytes[p] for p in held) + made[s])
            for p in held:
                if p not in seen:
                    seen.add(p)
                    stack.append(p)
        worst = max(worst, constants + firm_bytes[k] + chain)
    return worst
