"""Predict what a plan's regions cost when the executor runs them: replay the captured step with
the regions' saved tensors dropped after the forward and replayed in backward.

Why not take the solver's figures: a solver's model (NOTE [chain model], NOTE [graph model]) is
coarse on purpose (no parameter gradients, no backward temporaries, one block per stage), which is
what makes it fast to optimize over, but a user asks for a peak in bytes of the real step. This
module replays the captured Trace event by event (NOTE [replay semantics] in
``remat.trace.replay``) and changes exactly what the executor (``remat.planner.execute``, built on
``remat.scope``'s tape) changes. ``remat.plan`` uses it to check, and correct, every solver's plan.

NOTE [region model]
- A region is a run of forward ops. Its *targets* are the storages autograd saved that an op of the
  region made, not one of the region's SAVE ops, and that some op of the region reads (a storage
  only later ops read, such as a block's output, is saved by them: the region hands autograd no
  handle for it).
- A target no op after the region reads is *dropped*: it dies after its last forward reader instead
  of when backward releases it. Other targets stay alive as in the plain step.
- Just before the first backward op that reads a target, the region is *replayed*: the region's
  ops that lead to its targets run again (from its inputs and SAVE outputs) in forward order; each
  target comes back (a dropped one) or is made again beside the original (a kept one); values only
  the replay needs die after their last reader in it. A target then lives until the plain step
  releases it. Compute: the replayed ops' costs, once per backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from remat.trace.types import Op, Phase, Trace

__all__ = ["Prediction", "RegionOps", "predict"]


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
    targets: list[set[int]] = [set() for _ in regions]
    drop_after: dict[int, list[int]] = {}  # forward op index -> dropped targets that die after it
    for r in saved_roots:
        g = region_of.get(maker.get(r, -1), -1)
        if g < 0 or maker[r] in regions[g].save:
            continue
        inside = [i for i in readers.get(r, ()) if region_of.get(i) == g]
        if not inside and readers.get(r):
            continue
        targets[g].add(r)
        if all(region_of.get(i) == g for i in readers.get(r, ())):
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
    for g in range(len(regions)):  # a region whose targets backward never reads (a frozen block)
        if g not in replayed:
            targets[g].clear()

    handles = [0] * len(tensors)
    for info in tensors:
        if info.constant:
            handles[root[info.id]] += 1
    dropped: set[int] = set()
    copies: dict[int, int] = {}  # a kept target's replayed twin: root -> bytes
    made = 0
    peak, peak_op, peak_at = 0, -1, "start"
    recompute = 0.0

    def sample(op: Op, value: int, replaying: str = "") -> None:
        nonlocal peak, peak_op, peak_at
        if value > peak:
            peak, peak_op, peak_at = value, op.index, _where(op, replaying)

    def replay(g: int, before: Op) -> None:
        nonlocal made, recompute
        region = regions[g]
        ops = [trace.ops[i] for i in region.ops]
        need: set[int] = set()
        wanted = set(targets[g])
        for op in reversed(ops):  # the ops that lead to the targets, stopping at kept values
            outs = {root[t] for t in op.outputs}
            if op.index in region.save or not outs & wanted:
                continue
            need.add(op.index)
            wanted |= {
                root[t]
                for t in op.inputs
                if region_of.get(maker.get(root[t], -1)) == g and maker[root[t]] not in region.save
            }
        last_use: dict[int, int] = {}
        for op in ops:
            if op.index in need:
                for t in op.inputs:
                    last_use[root[t]] = op.index
        transient: dict[int, int] = {}
        name = names[g] if g < len(names) else f"region {g}"
        for op in ops:
            if op.index not in need:
                continue
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
            sample(before, made + sum(transient.values()), name)
            for r in [r for r in transient if last_use.get(r, -1) <= op.index]:
                del transient[r]

    for event in trace.events:
        if isinstance(event, Op):
            for g in replay_at.get(event.index, ()):
                replay(g, event)
            for t in event.outputs:
                r = root[t]
                if handles[r] == 0 and r not in dropped:
                    made += tensors[r].nbytes
                handles[r] += 1
            sample(event, made)
            for r in drop_after.get(event.index, ()):
                if handles[r] > 0 and r not in dropped:
                    made -= tensors[r].nbytes
                dropped.add(r)
        else:
            r = root[event.tensor]
            handles[r] -= 1
            if handles[r] == 0:
                if not tensors[r].constant and r not in dropped:
                    made -= tensors[r].nbytes
                made -= copies.pop(r, 0)
    base = math.fsum(c for op, c in zip(trace.ops, cost, strict=True) if op.phase is not Phase.OPTIMIZER)
    return Prediction(peak, peak_op, peak_at, base, recompute, tuple(frozenset(ts) for ts in targets))
