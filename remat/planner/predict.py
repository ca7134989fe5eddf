"""Predict what a plan's regions cost when the executor runs them: replay the captured step with
the regions' saved tensors dropped after the forward and replayed in backward.

Why not take the solver's figures: a solver's model (NOTE [chain model], NOTE [graph model]) is
coarse on purpose (no parameter gradients, no backward temporaries, one block per stage), which is
what makes it fast to optimize over, but a user asks for a peak in bytes of the real step. This
module replays the captured Trace event by event (NOTE [replay semantics] in
``remat.trace.replay``) and changes exactly what the executor (``remat.planner.execute``, built on
``remat.scope``'s tape) changes. ``remat.plan`` uses it to check, and correct, every solver's plan.

NOTE [region model]
- A region is a run of forward ops, recorded on a tape from just before its first op runs until
  just after its last op runs (NOTE [region end] in ``remat.planner.execute``): what its first op
  saves of its inputs and what its last op saves of its outputs go to autograd as in the plain step.
- A value the region *keeps* is the output of one of its SAVE ops that no later op of the region
  writes in place (the tape cannot keep a value an in-place op then changes: it replays the writer).
- Its *targets* are the storages an op of the region made, that it does not keep, and that
  autograd saved while the tape recorded (``Trace.saved_at``: after the first op and up to the
  last): for those the region hands autograd a handle, not the tensor. A storage only later ops
  save, such as a block's output, is theirs to hold. (A trace that does not place its saves gets
  an approximation: saved, not made by the region's last op, and read by an op of the region or
  by no forward op.)
- A target that no save outside the tape holds is *dropped*: it dies after its last forward
  reader instead of when backward releases it. Other targets stay alive as in the plain step.
- While it records, the tape holds what it keeps and the storages from outside the region that it
  reads; from the region's end, the values its replay reads from outside or kept stay held until
  the last backward op that reads a storage saved while the region recorded (the region, and its
  replay plan, live as long as autograd holds anything it packed; a save no backward op reads
  lives to the end of the step). A dropped target such a hold still holds dies when it ends.
- Just before the first backward op that reads a target, the region is *replayed*: the region's
  ops that lead to its targets run again (from its inputs and kept values) in forward order; each
  target comes back (a dropped one) or is made again beside the original (a kept one); values only
  the replay needs die after their last reader in it. A target then lives until the plain step
  releases it. Compute: the replayed ops' costs, once per backward.
- Besides tensors: while an op runs, its kernel's scratch buffers (``Op.scratch``) are live, in the
  forward and in a replay; the tape copies the generator's state for each random op it records
  (on CPU, where that state is memory of the device), held like a batch-norm snapshot, and a
  replay that runs a random op saves the state around itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from remat import aten
from remat.trace.types import Op, Phase, Trace

__all__ = ["Prediction", "RegionOps", "predict"]

# What the tape copies of the CPU generator for each random op it records (``torch.get_rng_state``).
_CPU_RNG_STATE_BYTES = torch.get_rng_state().untyped_storage().nbytes()


@dataclass(frozen=True)
class RegionOps:
    """A region in trace op indices: its forward ops (in order) and those whose outputs it keeps."""

    ops: tuple[int, ...]
    save: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Prediction:
    """Peak bytes of the step's own storages (constants excluded), the op where it is first reached
    (``peak_op``, a trace op index, and a description), the compute of the plain step and of the
    replays, and per region the trace tensors it recomputes."""

    peak_bytes: int
    peak_op: int
    peak_at: str
    base_cost: float
    recompute_cost: float
    recomputed: tuple[frozenset[int], ...]

    @property
    def overhead(self) -> float:
        return (self.base_cost + self.recompute_cost) / self.base_cost if self.base_cost > 0 else 1.0


def _writes(op: Op) -> tuple[int, ...]:
    """The tensors ``op`` writes in place: those it says it mutates and, for batch norm in training,
    the running statistics its schema does not declare (its last two tensor inputs when it has
    three or more: ``remat.manual.tape`` snapshots both kinds when an op of a region writes them). The
    trace does not say whether batch norm ran in training mode or tracks running statistics, so a
    frozen one (or one without statistics) is counted with a snapshot it does not take: an
    overestimate of two vectors of its channels."""
    hidden = aten.writes_hidden(op.name) and len(op.inputs) >= 3
    return tuple(dict.fromkeys((*op.mutates, *(op.inputs[-2:] if hidden else ()))))


def _where(op: Op, replaying: str = "") -> str:
    text = f"op {op.index} {op.name} in {op.module or '(top level)'}"
    return f"{text}, replaying {replaying}" if replaying else text


def predict(trace: Trace, regions: Sequence[RegionOps], names: Sequence[str] = ()) -> Prediction:
    """Replay ``trace`` under ``regions`` (NOTE [region model]); ``names`` label the regions."""
    tensors = trace.tensors
    root = [trace.root(t.id) for t in tensors]
    use_measured = trace.total_cost > 0
    cost = [op.cost if use_measured else op.est_cost for op in trace.ops]
    saved_roots = {root[t] for t in trace.saved}
    readers: dict[int, list[int]] = {}
    maker: dict[int, int] = {}
    for op in trace.ops:
        if op.phase is not Phase.FORWARD:
            continue
        for t in op.inputs:
            readers.setdefault(root[t], []).append(op.index)
        for t in op.outputs:
            if tensors[t].alias_of is None and not tensors[t].constant:
                maker.setdefault(t, op.index)

    region_of: dict[int, int] = {}
    for g, region in enumerate(regions):
        for i in region.ops:
            region_of[i] = g
    # what each region keeps: outputs of its SAVE ops that no later op of the region writes
    written: set[int] = set()  # roots an op of their own region writes in place
    for op in trace.ops:
        g = region_of.get(op.index, -1)
        for t in op.mutates:
            if g >= 0 and region_of.get(maker.get(root[t], -1)) == g:
                written.add(root[t])
    kept: list[set[int]] = [set() for _ in regions]
    for g, region in enumerate(regions):
        for i in region.save:
            for t in trace.ops[i].outputs:
                r = root[t]
                if maker.get(r) == i and r not in written:  # writers come after the maker
                    kept[g].add(r)
    # A save at position p (NOTE in ``Trace``) is in region g's tape when first < p <= last.
    window: dict[int, int] = {}
    for g, region in enumerate(regions):
        for p in range(region.ops[0] + 1, region.ops[-1] + 1) if region.ops else ():
            window[p] = g
    packed: list[set[int]] = [set() for _ in regions]  # roots saved while the region records
    held_by_autograd: set[int] = set()  # roots some save holds as in the plain step
    for t, p in trace.saved_at:
        r = root[t]
        g = window.get(p, -1)
        if g >= 0:
            packed[g].add(r)
        if g < 0 or r in kept[g] or region_of.get(maker.get(r, -1)) != g:
            held_by_autograd.add(r)
    targets: list[set[int]] = [set() for _ in regions]
    drop_after: dict[int, list[int]] = {}  # forward op index -> dropped targets that die after it
    for r in saved_roots:
        g = region_of.get(maker.get(r, -1), -1)
        if g < 0 or r in kept[g]:
            continue
        if trace.saved_at:
            if r not in packed[g]:
                continue
            dropped_early = r not in held_by_autograd
        else:  # when saves are not placed: those by an op of the region that reads the tensor
            inside = [i for i in readers.get(r, ()) if region_of.get(i) == g]
            if maker[r] == regions[g].ops[-1] or (not inside and readers.get(r)):
                continue
            dropped_early = all(region_of.get(i) == g for i in readers.get(r, ()))
        targets[g].add(r)
        if dropped_early:
            drop_after.setdefault(max([maker[r], *readers.get(r, ())]), []).append(r)

    replay_at: dict[int, list[int]] = {}  # backward op index -> regions replayed just before it
    owner = {r: g for g, ts in enumerate(targets) for r in ts}
    replayed: set[int] = set()
    for op in trace.ops:
        if op.phase is Phase.BACKWARD:
            for t in op.inputs:
                g = owner.get(root[t], -1)
                if g >= 0 and g not in replayed:
                    replayed.add(g)
                    replay_at.setdefault(op.index, []).append(g)
    # a region whose targets backward never reads (a frozen block) is never replayed, but its
    # replay plan is made, and holds what it reads, all the same
    planned = [set(ts) for ts in targets]
    for g in range(len(regions)):
        if g not in replayed:
            targets[g].clear()

    # The ops each replay runs: those that lead to the targets, stopping at kept values and at
    # values from outside the region; what they read of those is held by the region's plan.
    need: list[set[int]] = []
    held_by_plan: list[set[int]] = []
    for g, region in enumerate(regions):
        wanted = set(planned[g])
        ops_needed: set[int] = set()
        outside: set[int] = set()
        for i in reversed(region.ops):
            op = trace.ops[i]
            if not {root[t] for t in (*op.outputs, *op.mutates)} & wanted or any(
                root[t] in kept[g] and maker.get(root[t]) == i for t in op.outputs
            ):
                continue
            ops_needed.add(i)
            for t in op.inputs:
                r = root[t]
                if tensors[r].constant:
                    continue
                if region_of.get(maker.get(r, -1)) == g and r not in kept[g]:
                    wanted.add(r)
                else:
                    outside.add(r)
        need.append(ops_needed)
        held_by_plan.append(outside if planned[g] else set())

    # Holds of the tapes (NOTE [region model]): acquired at an op, released after another.
    last_saved_read: dict[int, int] = {}
    for op in trace.ops:
        if op.phase is Phase.BACKWARD:
            for t in op.inputs:
                last_saved_read[root[t]] = op.index
    hold_at: dict[int, list[int]] = {}
    unhold_after: dict[int, list[int]] = {}
    snapshots: dict[int, int] = {}  # op -> bytes of the copies the tape takes of what it writes
    unsnap_after: dict[int, int] = {}
    end = len(trace.ops) - 1  # a save no backward op reads is freed with the graph
    rng_bytes = _CPU_RNG_STATE_BYTES if trace.device == "cpu" else 0  # a CUDA state lives on the host
    for g, region in enumerate(regions):
        if not region.ops:
            continue
        first, last = region.ops[0], region.ops[-1]
        if not trace.saved_at:
            packed[g] = kept[g] | targets[g]
            for i in region.ops:
                if i != first:
                    packed[g].update(root[t] for t in trace.ops[i].inputs if root[t] in saved_roots)
        death = max((last_saved_read.get(r, end) for r in packed[g] if r in saved_roots), default=last)
        if not planned[g]:
            death = last
        seen: set[int] = set()
        for i in region.ops:
            op = trace.ops[i]
            written_outside = [t for t in _writes(op) if region_of.get(maker.get(root[t], -1)) != g]
            copied = sum(tensors[t].view_bytes for t in written_outside) + (rng_bytes if op.random else 0)
            if copied:
                snapshots[i] = snapshots.get(i, 0) + copied
                after = death if i in need[g] else last
                unsnap_after[after] = unsnap_after.get(after, 0) + copied
            outs = [root[t] for t in op.outputs if maker.get(root[t]) == i]
            reads = [root[t] for t in op.inputs]
            for r in [*reads, *outs]:
                if r in seen or tensors[r].constant:
                    continue
                if r in kept[g] or region_of.get(maker.get(r, -1)) != g:
                    seen.add(r)
                    hold_at.setdefault(i, []).append(r)
                    unhold_after.setdefault(last, []).append(r)
        for r in held_by_plan[g]:
            hold_at.setdefault(last, []).append(r)
            unhold_after.setdefault(death, []).append(r)

    handles = [0] * len(tensors)
    for info in tensors:
        if info.constant:
            handles[root[info.id]] += 1
    dropped: set[int] = set()
    pending: set[int] = set()  # dropped targets another region's tape or plan still holds
    copies: dict[int, int] = {}  # a kept target's replayed twin: root -> bytes
    holds: dict[int, int] = {}  # root -> holds of tapes and replay plans on it
    made = 0
    peak, peak_op, peak_at = 0, -1, "start"
    recompute = 0.0

    def sample(op: Op, value: int, replaying: str = "") -> None:
        nonlocal peak, peak_op, peak_at
        if value > peak:
            peak, peak_op, peak_at = value, op.index, _where(op, replaying)

    def replay(g: int, before: Op) -> None:
        nonlocal made, recompute
        ops = [trace.ops[i] for i in regions[g].ops if i in need[g]]
        last_use: dict[int, int] = {}
        for op in ops:
            for t in op.inputs:
                last_use[root[t]] = op.index
        # the replay saves the generator's state and restores it after (``remat.manual.replay``)
        transient: dict[int, int] = {-1: rng_bytes if any(op.random for op in ops) else 0}
        name = names[g] if g < len(names) else f"region {g}"
        for op in ops:
            recompute += cost[op.index]
            for t in op.outputs:
                r = root[t]
                if tensors[t].alias_of is not None or tensors[t].constant or maker.get(r) != op.index:
                    continue
                if r in targets[g]:
                    if r in dropped:
                        dropped.discard(r)
                        made += tensors[r].nbytes if handles[r] > 0 else 0
                    else:
                        copies[r] = tensors[r].nbytes
                        made += copies[r]
                else:
                    transient[r] = tensors[r].nbytes
            sample(before, made + sum(transient.values()) + op.scratch, name)
            for r in [r for r in transient if r >= 0 and last_use.get(r, -1) <= op.index]:
                del transient[r]

    def release(r: int) -> None:
        nonlocal made
        handles[r] -= 1
        if handles[r] == 0:
            if not tensors[r].constant and r not in dropped:
                made -= tensors[r].nbytes
            made -= copies.pop(r, 0)

    def drop(r: int) -> None:
        nonlocal made
        if handles[r] > 0 and r not in dropped:
            made -= tensors[r].nbytes
        dropped.add(r)

    for event in trace.events:
        if isinstance(event, Op):
            for g in replay_at.get(event.index, ()):
                replay(g, event)
            for t in event.outputs:
                r = root[t]
                if handles[r] == 0 and r not in dropped:
                    made += tensors[r].nbytes
                handles[r] += 1
            for r in hold_at.get(event.index, ()):
                if handles[r] > 0:
                    handles[r] += 1
                    holds[r] = holds.get(r, 0) + 1
            made += snapshots.get(event.index, 0)
            sample(event, made + event.scratch)
            for r in drop_after.get(event.index, ()):
                if holds.get(r, 0) > 0:
                    pending.add(r)
                else:
                    drop(r)
            made -= unsnap_after.get(event.index, 0)
            for r in unhold_after.get(event.index, ()):
                if holds.get(r, 0) > 0:
                    holds[r] -= 1
                    release(r)
                    if holds[r] == 0 and r in pending:
                        pending.discard(r)
                        drop(r)
        else:
            release(root[event.tensor])
    base = math.fsum(c for op, c in zip(trace.ops, cost, strict=True) if op.phase is not Phase.OPTIMIZER)
    return Prediction(peak, peak_op, peak_at, base, recompute, tuple(frozenset(ts) for ts in targets))
