"""Predict what a plan's regions cost when the executor runs them: replay the captured step with
the regions' saved tensors dropped after the forward and replayed in backward.

Why not take the solver's figures: the planner's cost model (``remat.planner.cost_model``, NOTE
[chain model], NOTE [DAG model]) is coarse on purpose (no parameter gradients, no backward
temporaries, one block per stage), which is what makes it fast to optimize over, but a user asks
for a peak in bytes of the real step. This module replays the captured Trace event by event (NOTE
[liveness semantics] in ``remat.trace.liveness``) and changes exactly what the executor
(``remat.planner.execute``, built on ``remat.scope``'s tape) changes; it evaluates one plan of
regions, not a schedule a solver may choose, so the two models share no code: the cost model's
values are blocks and nodes, this one's are the trace's storages. ``remat.plan`` uses it to check,
and correct, every solver's plan.

``predict`` runs in named steps: the facts of each region (``remat.planner.region_model``: what
it keeps, drops and replays), the tapes' holds and snapshots (``remat.planner.holds``), then one walk over
the step's events that counts the bytes alive (``_Walk``).

NOTE [region model]
- A region is a run of forward ops, recorded on a tape from just before its first op runs until
  just after its last op runs (NOTE [region end] in ``remat.planner.execute``): what its first op
  saves of its inputs and what its last op saves of its outputs go to autograd as in the plain step.
- A value the region *keeps* is the output of one of its SAVE ops that no later op of the region
  writes in place (the tape cannot keep a value an in-place op then changes: it replays the writer).
- Its *targets* are the storages an op of the region made (or wrote in place, having been made
  before it: NOTE [written from outside] in ``remat.planner.region_model``), that it does not keep,
  and that autograd saved while the tape recorded (``Trace.saved_at``: after the first op and up to
  the last): for those the region hands autograd a handle, not the tensor. A storage only later ops
  save, such as a block's output, is theirs to hold. (A trace that does not place its saves gets an
  approximation: saved, not made by the region's last op, and read by an op of the region or by no
  forward op.)
- A target that no save outside the tape holds is *dropped*: it dies after its last forward
  reader instead of when backward releases it. Other targets stay alive as in the plain step.
- While it records, the tape holds what it keeps and the storages from outside the region that it
  reads; from the region's end, the values its replay reads from outside or kept stay held until
  the last backward op that reads a storage saved while the region recorded (the region, and its
  replay plan, live as long as autograd holds anything it packed; a save no backward op reads
  lives to the end of the step). A save goes with the node that made it: its last read is the last
  by a backward op of the region's modules (backward ops carry the module of the forward op whose
  node runs them), so a storage every block saves, such as a rotary table or a mask, does not keep
  the first block's plan alive to the last block's backward. A dropped target such a hold still
  holds dies when it ends.
- Just before the first backward op that reads a target and that a node of the region runs (of
  one of the region's modules: only those unpack a handle, while a later block that saved the
  same storage itself holds it as in the plain step), the region is *replayed*: the region's
  ops that lead to its targets run again (from its inputs and kept values) in forward order; each
  target comes back (a dropped one) or is made again beside the original (a kept one); values only
  the replay needs die after their last reader in it. A target then lives until the plain step
  releases it. Compute: the replayed ops' costs, once per backward.
- Besides tensors: while an op runs, its kernel's scratch buffers (``Op.scratch``) are live, in the
  forward and in a replay; the tape copies the generator's state for each random op it records
  (on CPU, where that state is memory of the device), held like a batch-norm snapshot, and a
  replay that runs a random op saves the state around itself.
- Time besides the kernels (NOTE [executor cost] in ``remat.planner.cost_model``): every forward op
  of the model (those the executor counts) is checked, every op of a region recorded, every op a
  replay runs is run again from the tape, every storage in ``moved`` goes to the host and back;
  ``Prediction.executor_cost`` is that work (``Prediction.work``) at the given per-op figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from remat import aten
from remat._units import format_bytes
from remat.planner import given
from remat.planner.cost_model import NO_EXECUTOR_COST, ExecutorCost, ExecutorWork
from remat.planner.execute import UNCOUNTED
from remat.planner.holds import Holds, tape_holds
from remat.planner.region_model import (
    RegionOps,
    RegionPlans,
    StepFacts,
    kept_values,
    outside_writes,
    region_targets,
    replay_ops,
    replay_points,
    step_facts,
)
from remat.trace.types import Op, Phase, Trace

__all__ = ["Prediction", "predict"]

# What the tape copies of the CPU generator for each random op it records (``torch.get_rng_state``).
_CPU_RNG_STATE_BYTES = torch.get_rng_state().untyped_storage().nbytes()


@dataclass(frozen=True)
class Prediction:
    """Peak bytes of the step's own storages (constants excluded), the op where it is first reached
    (``peak_op``, a trace op index, and a description), the compute of the plain step and of the
    replays, and per region the trace tensors it recomputes; the executor's own time besides the
    kernels (``executor_cost``, seconds) for the ``work`` it does (NOTE [executor cost])."""

    peak_bytes: int
    peak_op: int
    peak_at: str
    base_cost: float
    recompute_cost: float
    recomputed: tuple[frozenset[int], ...]
    held_bytes: int = 0  # alive when the forward's last op is done: what backward is left to free
    stall_cost: float = 0.0  # seconds the compute waits for the link (``remat.planner.offload_search``)
    executor_cost: float = 0.0
    work: ExecutorWork = ExecutorWork()

    @property
    def overhead(self) -> float:
        spent = self.base_cost + self.recompute_cost + self.stall_cost + self.executor_cost
        return spent / self.base_cost if self.base_cost > 0 else 1.0

    @property
    def executor_overhead(self) -> float:
        """The executor's part of ``overhead``: its seconds ÷ the plain step's."""
        return self.executor_cost / self.base_cost if self.base_cost > 0 else 0.0


def _where(op: Op, replaying: str = "") -> str:
    text = f"op {op.index} {op.name} in {op.module or '(top level)'}"
    return f"{text}, replaying {replaying}" if replaying else text


def predict(
    trace: Trace,
    regions: Sequence[RegionOps],
    names: Sequence[str] = (),
    moved: Sequence[tuple[int, int, int]] = (),
    executor: ExecutorCost = NO_EXECUTOR_COST,
) -> Prediction:
    """Replay ``trace`` under ``regions`` (NOTE [region model]); ``names`` label the regions.
    ``moved``: storages offloaded, ``(root, gone after op, back before op)``: off the device after
    the first op and until just before the second. ``executor``: the executor's per-op figures
    (NOTE [executor cost]; the default, zero, leaves the executor out)."""
    if not isinstance(trace, Trace) or not all(isinstance(r, RegionOps) for r in regions):
        given.a(trace, Trace, "planner.predict", "trace", "pass remat.planner.trace_step(...)'s trace")
        given.a(regions, (list, tuple), "planner.predict", "regions", "pass a list of RegionOps")
        for region in regions:
            given.a(
                region, RegionOps, "planner.predict", "each region", "pass the regions of a plan (RegionOps)"
            )
    facts = step_facts(trace, regions)
    kept = kept_values(trace, regions, facts)
    written = outside_writes(trace, regions, facts)
    planned, packed, drop_after = region_targets(trace, regions, facts, kept, written)
    replay_at = replay_points(trace, regions, facts, planned)
    replayed = {g for gs in replay_at.values() for g in gs}
    # a region whose targets backward never reads (a frozen block) is never replayed, but its
    # replay plan is made, and holds what it reads, all the same
    targets = [ts if g in replayed else set() for g, ts in enumerate(planned)]
    need, held_by_plan, snapped = replay_ops(trace, regions, facts, kept, planned, written)
    plans = RegionPlans(kept, packed, planned, targets, need, held_by_plan, written, snapped)
    rng_bytes = _CPU_RNG_STATE_BYTES if trace.device == "cpu" else 0  # a CUDA state lives on the host
    holds = tape_holds(trace, regions, facts, plans, rng_bytes)
    walk = _Walk(trace, regions, names, facts, plans, rng_bytes)
    for r, gone, back in moved:
        drop_after.setdefault(gone, []).append(r)
        walk.reloads.setdefault(back, []).append(r)
    walk.run(replay_at, drop_after, holds)
    costs = zip(trace.ops, facts.cost, strict=True)
    base = math.fsum(c for op, c in costs if op.phase is not Phase.OPTIMIZER)
    recomputed = tuple(frozenset(ts) for ts in targets)
    bare = {i for r in regions if r.rerun is not None for i in r.ops}  # NOTE [module re-run]
    checked = sum(
        op.phase is Phase.FORWARD and bool(op.module) and op.name not in UNCOUNTED and op.index not in bare
        for op in trace.ops
    )
    recorded = sum(len(r.ops) for r in regions if r.rerun is None)
    if not moved and all(r.rerun is not None or r.anchored for r in regions):
        # NOTE [bare forward] in ``remat.planner.module_calls``: the steady state, where a taped
        # region runs from its template unless it may not (NOTE [taped call run bare])
        checked = recorded = sum(len(r.ops) for r in regions if r.rerun is None and not _templated(trace, r))
    work = ExecutorWork(checked, recorded, walk.replayed, len(moved))
    unseen = trace.unseen_bytes  # NOTE [unseen bytes] in ``remat.trace.types``: held throughout
    peak_at = walk.peak_at + (f", with {format_bytes(unseen)} no op made (measured)" if unseen else "")
    return Prediction(
        walk.peak + unseen,
        walk.peak_op,
        peak_at,
        base,
        walk.recompute,
        recomputed,
        walk.held + unseen,
        executor_cost=executor.seconds(work),
        work=work,
    )


class _Walk:
    """One pass over the step's events under the plan: the bytes alive after each op (storages
    with a handle, snapshots, replayed copies) and the largest sample with where it happened."""

    def __init__(
        self,
        trace: Trace,
        regions: Sequence[RegionOps],
        names: Sequence[str],
        facts: StepFacts,
        plans: RegionPlans,
        rng_bytes: int,
    ) -> None:
        self.trace, self.regions, self.names = trace, regions, names
        self.facts, self.plans, self.rng_bytes = facts, plans, rng_bytes
        self.handles = [0] * len(trace.tensors)
        for info in trace.tensors:
            if info.constant:
                self.handles[facts.root[info.id]] += 1
        self.dropped: set[int] = set()
        self.pending: set[int] = set()  # dropped targets another region's tape or plan still holds
        self.copies: dict[int, int] = {}  # a kept target's replayed twin: root -> bytes
        self.holds: dict[int, int] = {}  # root -> holds of tapes and replay plans on it
        self.made = 0
        self.peak, self.peak_op, self.peak_at = 0, -1, "start"
        self.recompute = 0.0
        self.replayed = 0  # ops the replays run
        self.held = 0
        self.reloads: dict[int, list[int]] = {}  # op -> offloaded storages back just before it

    def sample(self, op: Op, value: int, replaying: str = "") -> None:
        if value > self.peak:
            self.peak, self.peak_op, self.peak_at = value, op.index, _where(op, replaying)

    def replay(self, g: int, before: Op) -> None:
        """Region ``g``'s replay just before backward op ``before``."""
        trace, root, tensors = self.trace, self.facts.root, self.trace.tensors
        ops = [trace.ops[i] for i in self.regions[g].ops if i in self.plans.need[g]]
        again = self.regions[g].rerun
        last_use: dict[int, int] = {}
        gone = -1  # a value no op of the replay reads dies after the op that makes it
        if again is None:
            self.replayed += len(ops)
            for op in ops:
                for t in op.inputs:
                    last_use[root[t]] = op.index
        else:  # NOTE [module re-run]: a value lives as long as the forward kept it
            last_use, gone = trace.forward_deaths, len(trace.ops)
        # the replay saves the generator's state and restores it after (``remat.manual.replay``);
        # a module re-run, always (``remat.planner.rerun``)
        drawn = again is not None or any(op.random for op in ops)
        transient: dict[int, int] = {-1: self.rng_bytes if drawn else 0}
        name = self.names[g] if g < len(self.names) else f"region {g}"
        for op in ops:
            self.recompute += self.facts.cost[op.index]
            for t in op.outputs:
                r = root[t]
                if (
                    tensors[t].alias_of is not None
                    or tensors[t].constant
                    or self.facts.maker.get(r) != op.index
                ):
                    continue
                if r in self.plans.targets[g]:
                    self.remake(r, tensors[r].nbytes)
                else:
                    transient[r] = tensors[r].nbytes
            for t in op.mutates:  # into a clone of the snapshot (NOTE [written from outside])
                r = root[t]
                if self.plans.written[g].get(t) == op.index:
                    if r in self.plans.targets[g]:
                        self.remake(r, tensors[t].view_bytes)
                    else:
                        transient[r] = tensors[t].view_bytes
            self.sample(before, self.made + sum(transient.values()) + op.scratch, name)
            for r in [r for r in transient if r >= 0 and last_use.get(r, gone) <= op.index]:
                del transient[r]

    def remake(self, r: int, size: int) -> None:
        """A replay makes target ``r`` again: back where it was dropped, else a copy of ``size``
        bytes beside the original until the original goes."""
        if r in self.dropped:
            self.dropped.discard(r)
            self.made += self.trace.tensors[r].nbytes if self.handles[r] > 0 else 0
        else:
            self.copies[r] = self.copies.get(r, 0) + size
            self.made += size

    def release(self, r: int) -> None:
        self.handles[r] -= 1
        if self.handles[r] == 0:
            if not self.trace.tensors[r].constant and r not in self.dropped:
                self.made -= self.trace.tensors[r].nbytes
            self.made -= self.copies.pop(r, 0)

    def drop(self, r: int) -> None:
        if r in self.trace.outliving:  # the program holds it still (NOTE [held past the step])
            return
        if self.handles[r] > 0 and r not in self.dropped:
            self.made -= self.trace.tensors[r].nbytes
        self.dropped.add(r)

    def run(self, replay_at: dict[int, list[int]], drop_after: dict[int, list[int]], holds: Holds) -> None:
        root, tensors = self.facts.root, self.trace.tensors
        for event in self.trace.events:
            if not isinstance(event, Op):
                self.release(root[event.tensor])
                continue
            for g in replay_at.get(event.index, ()):
                self.replay(g, event)
            for r in self.reloads.get(event.index, ()):
                if r in self.dropped:
                    self.dropped.discard(r)
                    self.made += tensors[r].nbytes if self.handles[r] > 0 else 0
            for t in event.outputs:
                r = root[t]
                if self.handles[r] == 0 and r not in self.dropped:
                    self.made += tensors[r].nbytes
                self.handles[r] += 1
            for r in holds.hold_at.get(event.index, ()):
                if self.handles[r] > 0:
                    self.handles[r] += 1
                    self.holds[r] = self.holds.get(r, 0) + 1
            self.made += holds.snapshots.get(event.index, 0)
            self.sample(event, self.made + max(event.scratch, holds.after_draw.get(event.index, 0)))
            for r in drop_after.get(event.index, ()):
                if self.holds.get(r, 0) > 0:
                    self.pending.add(r)
                else:
                    self.drop(r)
            self.made -= holds.unsnap_after.get(event.index, 0)
            for r in holds.unhold_after.get(event.index, ()):
                if self.holds.get(r, 0) > 0:
                    self.holds[r] -= 1
                    self.release(r)
                    if self.holds[r] == 0 and r in self.pending:
                        self.pending.discard(r)
                        self.drop(r)
            if event.phase is Phase.FORWARD:
                self.held = self.made


def _templated(trace: Trace, region: RegionOps) -> bool:
    """Whether later calls of an anchored taped region run from a template (NOTE [taped call run
    bare] in ``remat.planner.taped_calls``), as far as the trace tells: no op of it hands Python a
    value. What it cannot tell (a tensor the region reads that a later call does not hand it, a
    random op with no save before it) leaves the region recorded, and dearer than predicted."""
    return region.anchored and not any(
        trace.ops[i].name.rsplit(".", 1)[0] in aten.VALUE_PACKETS for i in region.ops
    )
