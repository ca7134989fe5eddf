"""The worst case of a program under the runtime: the most bytes it can need at once, whatever was
evicted before, so a budget at which counting bytes never runs out of memory and never relaxes a
lock, so never loops for ever (it may still recompute a lot).

NOTE [worst case] The working set (``Telemetry.working_set``: the most bytes an op needs at its
first run, or the end, where everything the program keeps is resident at once) is what no budget
can go below; it is not enough. Three things need more:

- A restore re-runs its producer whole: every output gets memory again (a by-product as a
  transient block), the gathered inputs include the inputs of the views re-derived with it, and
  the constants are those of the moment of the restore, not of the first run.
- An op gathers its inputs one after another, each locked once resident: restoring one runs its
  restore chain beside the others, and each restore in that chain gathers its own inputs the same
  way. Relaxing those locks (NOTE [relaxed locks] in :mod:`remat.core.runtime`) lets a restore run
  beside less, but the caller must then gather again, and the inputs it had may be gone: two
  inputs of one op whose restore chains do not fit beside each other evict each other for ever.
  A random program (seed 83 of ``tests/sim``'s regressions) needs 369 B for its last op's two
  inputs, whatever the order they are gathered in, where each restore on its own fits in 361 B.
- :meth:`~remat.core.runtime.Runtime.finish` holds what the program keeps firm, in the order the
  storages were made, and firm locks are never relaxed: restoring a kept storage that was evicted
  re-runs its chain beside every kept storage made before it. A random program (seed 54 of
  ``tests/sim``'s regressions) keeps ``a`` (70 B), ``b`` (58 B) and ``c`` (31 B), where ``c``'s op
  also makes a 72 B by-product: with 75 B of constants its working set is 238 B, but restoring
  ``c`` at the end beside ``a`` and ``b`` needs 75 + 70 + 58 + 72 + 31 = 306 B.

:func:`worst_case` takes every storage that is neither a constant nor held firm as evicted, and
every input of a gathering op but the one being restored as held: a restore of ``s`` whose gather
holds ``S`` bytes of inputs needs ``need(s) = max(S + made(s), S - size(p) + need(p) for each
input p)`` beyond what its callers hold, where ``made`` is its run's outputs and scratch. The figure
is the constants plus the largest of those needs: of every restore, of every first run's gather,
and of each kept storage's restore at the end beside the kept storages before it (its chain walked
with them held firm). At that budget every allocation fits once everything evictable is evicted,
so no lock is ever relaxed and every gather ends (with no storage marked wanted: NOTE [wanted at
the end] in :mod:`remat.core.residency` evicts those only after relaxing). It bounds memory, not
recomputation: a run at it may restore one chain again and again (a chain read again after each
eviction) and pass the thrash limit, but it ends. It is a bound, not the least budget that works:
taking every other input as held at every level of a chain is what an unlucky history can reach,
but most runs finish well below it by relaxing locks (every greedy policy finishes seed 317 of
``tests/sim``'s regressions at 192 B, where its figure is 261 B; a deep chain's figure grows with
its depth where the byte count of any one restore does not). Below it a run may finish, run out,
or thrash until the thrash limit stops it. Nor is it ever above the peak of the run ``state`` made
with room for everything: at that budget nothing is evicted at all (seed 83's bound, 504 B, is
above its peak, 457 B, which is then its figure)."""

from __future__ import annotations

from collections.abc import Sequence

from remat.core.residency import Residency


def worst_case(state: Residency) -> int:
    """The worst case (NOTE [worst case]) of the program ``state`` has run to its end."""
    graph = state.graph
    nbytes, constant = graph.nbytes, graph.constant
    count = len(graph)
    constants = sum(n for n, fixed in zip(nbytes, constant, strict=True) if fixed)  # never evicted
    # Only these can be evicted and restored (an empty storage stays resident).
    movable = [not constant[s] and nbytes[s] > 0 for s in range(count)]
    made = [0] * count  # bytes the producer's run allocates: every output, and its scratch
    for record in graph.records:
        allocated = sum(nbytes[o] for o in record.outputs) + record.op.scratch
        for output in record.outputs:
            made[output] = allocated
    kept = [s for s in range(count) if state.live[s] > 0 and movable[s]]
    need: dict[int, int] = {}
    fill_needs(state, movable, made, [s for s in range(count) if movable[s]], need)
    worst = max([state.telemetry.working_set] + [constants + n for n in need.values()])
    for record in graph.records:  # each first run gathers its inputs
        worst = max(worst, constants + gather([s for s in record.inputs if movable[s]], nbytes, need))
    # ``finish`` restores the kept storages in order, each beside those before it held firm, which
    # its chain finds resident: once a storage is firm, the needs of its descendants are found again
    # (each at most once per firm ancestor; a kept loss made early is one).
    firm = 0
    children = graph.children
    for storage in kept:
        fill_needs(state, movable, made, [storage], need)
        worst = max(worst, constants + firm + need[storage])
        movable[storage] = False
        firm += nbytes[storage]
        stale = list(children[storage])
        while stale:
            s = stale.pop()
            if need.pop(s, None) is not None:
                stale.extend(children[s])
    return min(worst, state.telemetry.peak_bytes)  # with room for its peak, nothing is evicted


def gather(inputs: Sequence[int], nbytes: Sequence[int], need: dict[int, int]) -> int:
    """The most bytes gathering ``inputs`` (all evicted, restored one after another, each beside
    the others held) takes beyond what its callers hold."""
    total = sum(nbytes[p] for p in inputs)
    return total + max([0] + [need[p] - nbytes[p] for p in inputs])


def fill_needs(
    state: Residency, movable: list[bool], made: list[int], roots: list[int], need: dict[int, int]
) -> None:
    """Add to ``need`` (NOTE [worst case]) ``roots`` and every ancestor they restore that it lacks,
    where only the ``movable`` storages are ever evicted; parents first, walked without recursion."""
    graph = state.graph
    nbytes, parents = graph.nbytes, graph.parents
    walking: set[int] = set()
    for root in roots:
        stack = [(root, False)]
        while stack:
            s, ready = stack.pop()
            sources = [p for p in parents[s] if movable[p]]
            if ready:
                walking.discard(s)
                # a parent still being walked is one of its descendants (a view of several inputs):
                # its own bytes stand for it
                known = {p: need.get(p, nbytes[p]) for p in sources}
                need[s] = max(gather(sources, nbytes, known), sum(nbytes[p] for p in sources) + made[s])
            elif s not in need and s not in walking:
                walking.add(s)
                stack.append((s, True))
                stack.extend((p, False) for p in sources if p not in need and p not in walking)
