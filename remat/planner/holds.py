"""What the tapes and replay plans of a plan's regions hold while the step runs (NOTE [region model]
in ``remat.planner.predict``): the storages a tape reads from outside its region while it records,
what each replay plan reads, and the snapshots a tape takes of what its ops overwrite (NOTE
[blank writes] in ``remat.manual.blank``, NOTE [written from outside] in
``remat.planner.region_model``) or of the generator before a random op."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat import aten
from remat.planner.region_model import RegionOps, RegionPlans, StepFacts, writes
from remat.trace.types import Op, Trace

__all__ = ["Holds", "tape_holds"]


def _blank(
    op: Op, t: int, i: int, readers: dict[int, set[int]], saved_later: set[int], root: Sequence[int]
) -> bool:
    """Whether the tape lets go of its snapshot of ``t``, which op ``i`` writes, when the region
    ends (NOTE [blank writes] in ``remat.manual.blank``): a hidden write of batch norm's that no
    other op of the region reads, and that autograd does not save after the write while the region
    records (the tape would replay it for that save). Where saves are not placed, never: the
    prediction then counts the copy to the replay, as many bytes or more."""
    r = root[t]
    hidden = aten.writes_hidden(op.name) and t in op.inputs[-2:] and t not in op.mutates
    return hidden and r not in saved_later and not any(r in rs for j, rs in readers.items() if j != i)


@dataclass(frozen=True)
class Holds:
    """What the tapes and replay plans hold, by op: storages acquired at an op and released after
    another, and the bytes of the snapshots they take."""

    hold_at: dict[int, list[int]]
    unhold_after: dict[int, list[int]]
    snapshots: dict[int, int]
    unsnap_after: dict[int, int]
    # NOTE [where a draw left the generators]: the copy the tape takes just after a recorded draw,
    # let go at once (no kernel scratch is held by then)
    after_draw: dict[int, int]


def _released(trace: Trace, r: int, modules: set[str], otherwise: int) -> int:
    """When autograd lets go of storage ``r`` that a region with forward ops in ``modules`` packed:
    the save goes with its node, so after the last read by a backward op of those modules (not by
    another region's node that saved the same storage: a rotary table, a mask) and the rest of that
    node's ops, which the plain step's free of ``r`` bounds; a storage no backward op of the region
    reads is counted to ``otherwise``."""
    reads = trace.backward_reads
    mine = [reads[r, m] for m in modules if (r, m) in reads]
    if not mine:
        return otherwise
    last = max(mine)
    node_end = trace.backward_runs[last]
    return max(last, min(node_end, trace.released_after.get(r, node_end)))


def tape_holds(
    trace: Trace, regions: Sequence[RegionOps], facts: StepFacts, plans: RegionPlans, rng_bytes: int
) -> Holds:
    """Holds of the tapes and replay plans (NOTE [region model]), and the snapshots they take."""
    root, tensors = facts.root, trace.tensors
    last_saved_read: dict[int, int] = {}
    for (r, _), i in trace.backward_reads.items():
        last_saved_read[r] = max(i, last_saved_read.get(r, -1))
    holds = Holds({}, {}, {}, {}, {})
    end = len(trace.ops) - 1  # a save no backward op reads is freed with the graph
    for g, region in enumerate(regions):
        if not region.ops:
            continue
        first, last = region.ops[0], region.ops[-1]
        packed = plans.packed[g]
        if not trace.saved_at:
            packed = plans.kept[g] | plans.targets[g]
            for i in region.ops:
                if i != first:
                    packed.update(root[t] for t in trace.ops[i].inputs if root[t] in facts.saved_roots)
        if region.rerun is not None and trace.saved_at:  # its hooks see its first op's input saves
            ins = {root[t] for t in trace.ops[first].inputs}
            packed = packed | {r for t, p in trace.saved_at if p == first and (r := root[t]) in ins}
        modules = {trace.ops[i].module for i in region.ops}
        packs_until = max(
            (
                _released(trace, r, modules, last_saved_read.get(r, end))
                for r in packed
                if r in facts.saved_roots
            ),
            default=last,
        )
        death = packs_until if plans.planned[g] else last
        seen: set[int] = set()
        readers = {i: {root[t] for t in trace.ops[i].inputs} for i in region.ops}
        follows = False  # the region's last drawing op so far is replayed
        for i in region.ops:
            op = trace.ops[i]
            written_outside = [t for t in writes(op) if facts.region_made(root[t]) != g]
            blank = []
            if written_outside and trace.saved_at and aten.writes_hidden(op.name):
                later = {root[t] for t, p in trace.saved_at if i < p <= last}  # the tape's handles
                blank = [t for t in written_outside if _blank(op, t, i, readers, later, root)]
            drawn = rng_bytes if op.random and region.rerun is None else 0  # a re-run: one, below
            if drawn:
                holds.after_draw[i] = drawn
            replayed = i in plans.need[g]
            keeps_state = replayed and not follows  # NOTE [one state per run of draws] in ``remat.aten``
            follows = replayed if op.random else follows
            for t, size in [*((t, tensors[t].view_bytes) for t in written_outside), (-1, drawn)]:
                if not size:
                    continue
                holds.snapshots[i] = holds.snapshots.get(i, 0) + size
                # the replay plan reads it, when it runs the op or reads what the op overwrote
                # (NOTE [written from outside]), and the tape keeps that of a write into a view
                # (instance norm's running statistics) to the replay; a blank write lets it go all the same
                read = (replayed and (t >= 0 or keeps_state)) or (
                    t >= 0 and (root[t] in plans.snapped[g] or tensors[t].alias_of is not None)
                )
                after = last if t in blank or not read else death
                holds.unsnap_after[after] = holds.unsnap_after.get(after, 0) + size
            outs = [root[t] for t in op.outputs if facts.maker.get(root[t]) == i]
            for r in [*(root[t] for t in op.inputs), *outs]:
                if r in seen or tensors[r].constant:
                    continue
                if r in plans.kept[g] or facts.region_made(r) != g:
                    seen.add(r)
                    holds.hold_at.setdefault(i, []).append(r)
                    holds.unhold_after.setdefault(last, []).append(r)
        for r in plans.held_by_plan[g]:
            holds.hold_at.setdefault(last, []).append(r)
            holds.unhold_after.setdefault(death, []).append(r)
        if region.rerun is not None:  # the generators' state its call started with, kept by its
            # frame, which every save's handle refers to, planned or not
            holds.snapshots[first] = holds.snapshots.get(first, 0) + rng_bytes
            holds.unsnap_after[packs_until] = holds.unsnap_after.get(packs_until, 0) + rng_bytes
    return holds
