"""Where a budget leaves no room: for each op of one step's backward, the bytes it needs at once
(constants, the gradients wanted at the end by then, its own inputs, outputs and scratch), against
the pool at each ratio; and the step's own trace replayed by the core at each ratio, with the
thrash limit raised, to see how far and at what cost each policy gets, with the gradients wanted
at the end and without.

The trace and the marks are a no-budget region's (``cost="model"``), taken at its second step as
``run.py`` takes its peak; the pool is ``run.py``'s (budget less a 10% reserve, addresses, best fit).

    .venv/bin/python benchmarks/dynamic/floor.py resnet50 --limits 3 100
    .venv/bin/python benchmarks/dynamic/floor.py resnet50 --batch 32 --ratios 0.5 0.4 --limits 3 20

``--oracles`` replays two more greedy policies that know the trace's future, which no online
policy does: ``next-use`` evicts the storage whose next read by the program is farthest
(Belady's rule), ``next-use-cost`` the one of least c' / (m d), DTR's score with the distance
``d`` to the next read in place of the staleness (c' by equivalence classes). ``--planned``
plans the same step with ``remat.plan(budget="min")``: the smallest peak a static plan of
remat's planner reaches, beside the constants, measured by the allocator, in the pool's ratio.
"""

from __future__ import annotations

import argparse
import bisect
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from run import WORKLOADS, step  # this folder is on the path when the script runs

import remat
from remat.core.driver import Thrashed, deep_recursion, make_pool
from remat.core.policies import get
from remat.core.policies.base import Greedy, candidates
from remat.core.policies.registry import register
from remat.core.pool import OutOfMemory
from remat.core.residency import Residency
from remat.core.runtime import Runtime
from remat.sim.backend import SimBackend, drive
from remat.trace.types import Trace


@dataclass(frozen=True)
class NextUse(Greedy):
    """A policy that knows when the program reads each tensor next (``reads``: trace tensor -> the
    sorted op positions reading it or a view of it): Belady's farthest next read, or with
    ``cost`` DTR's score with that distance in place of the staleness."""

    name: str = "next-use"
    cost: bool = False
    reads: dict[int, list[int]] = field(default_factory=dict, compare=False)
    needs: frozenset[str] = frozenset({"classes"})

    def distance(self, runtime: Residency, storage: int) -> float:
        now, soonest = len(runtime.graph.records), math.inf
        for handle in runtime._members[storage]:
            positions = self.reads.get(handle, ())
            k = bisect.bisect_left(positions, now)
            if k < len(positions):
                soonest = min(soonest, positions[k])
        return soonest - now + 1

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        storages = candidates(runtime)
        if len(storages) == 0:
            return []
        far = np.array([min(self.distance(runtime, int(s)), 1e9) for s in storages])
        if not self.cost:
            return [int(storages[int(np.argmax(far))])]
        graph, resident, classes = runtime.graph, runtime.resident, runtime.classes
        assert classes is not None
        near = [graph.cost[int(s)] + classes.neighbour_cost(int(s), graph, resident) for s in storages]
        return [int(storages[int(np.argmin(np.array(near) / (graph.nbytes_array[storages] * far)))])]


def oracles(trace: Trace) -> tuple[str, ...]:
    """Register the two :class:`NextUse` policies for ``trace``; their names."""
    tensors, reads = trace.tensors, {}
    for position, op in enumerate(trace.ops):
        for tensor in {*op.inputs, *op.mutates}:
            root = tensor
            while tensors[root].alias_of is not None:
                root = tensors[root].alias_of
            for handle in {tensor, root}:
                reads.setdefault(handle, []).append(position)
    register(NextUse("next-use", False, reads))
    register(NextUse("next-use-cost", True, reads))
    return ("next-use", "next-use-cost")


def replay(trace: Trace, wants: tuple[tuple[int, int], ...], capacity: int, policy: str, limit: float) -> str:
    """The core over ``trace`` as ``DynamicStats.compare`` runs it: how far, at what cost; and
    where the program's ops all ran, the hand-over too (what the program holds at its end made
    resident: the parameters' gradients above all), under the same thrash limit."""
    backend = SimBackend(trace.total_cost, len(trace.ops), limit)
    runtime = Runtime(make_pool(capacity, True, "best"), get(policy), backend, compact=True)
    runtime.expect(wants)
    try:
        drive(runtime, trace, backend, finish=False)
        outcome = "ok"
    except Thrashed:
        outcome = f"thrash at op {len(runtime.graph.records)}"
    except OutOfMemory:
        outcome = f"no room at op {len(runtime.graph.records)}"
    cost = backend.meter.recompute_cost / trace.total_cost
    text = f"{outcome}, {runtime.telemetry.recomputations} recomputations, recomputed cost {cost:.2f}x"
    if outcome != "ok":
        return text
    try:
        with deep_recursion():
            runtime.finish()
        end = "ok"
    except Thrashed:
        end = "thrash"
    except OutOfMemory:
        end = "no room"
    cost = backend.meter.recompute_cost / trace.total_cost
    return f"{text}; with the hand-over: {end}, {runtime.telemetry.recomputations}, {cost:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.7, 0.5, 0.4])
    parser.add_argument("--limits", type=float, nargs="+", default=[3.0])
    parser.add_argument("--batch", type=int, default=None, help="resnet50's images per step (16)")
    parser.add_argument("--oracles", action="store_true", help="also replay two policies told the future")
    parser.add_argument("--planned", action="store_true", help="also the static planner's smallest plan")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, loss = WORKLOADS[args.workload](False, *(() if args.batch is None else (args.batch,)))
    model.train()
    free = remat.dynamic(None, "dtr", keep=model, cost="model")
    step(model, loss, free)
    step(model, loss, free)
    stats = free.stats
    trace, wants, peak = stats.trace, stats.wants, stats.peak_bytes
    tensors = trace.tensors
    constants = sum(t.nbytes for t in tensors if t.constant)
    first_backward = next(i for i, op in enumerate(trace.ops) if "backward" in op.name)
    worst = (0, 0, 0, 0)  # bytes at once, op, wanted by then, its own
    for index in range(first_backward, len(trace.ops)):
        op = trace.ops[index]
        reads = {t if tensors[t].alias_of is None else tensors[t].alias_of for t in op.inputs}
        own = sum(tensors[t].nbytes for t in reads if not tensors[t].constant) + op.scratch
        own += sum(tensors[t].nbytes for t in op.outputs if tensors[t].alias_of is None)
        wanted = sum(tensors[h].nbytes for at, h in wants if at <= index)
        worst = max(worst, (constants + wanted + own, index, wanted, own))
    total, index, wanted, own = worst
    print(f"{args.workload}: no-budget peak {peak} B, constants {constants} B")
    print(
        f"most at once in the backward: op {index} ({trace.ops[index].name}): constants + wanted "
        f"{wanted} B + its inputs, outputs and scratch {own} B = {total} B "
        f"(the pool at ratio {total / 0.9 / peak:.3f})"
    )
    if args.planned:
        lowest = remat.plan(model, (), "min", loss_fn=lambda _: loss())
        model.zero_grad(set_to_none=True)
        with remat.memory.track(allocator=True) as measured, lowest.apply(model):
            loss().backward()
        print(
            f"static planner, smallest plan: {lowest.predicted_peak_bytes} B predicted, "
            f"{measured.peak_bytes} B measured beside the constants (the pool at ratio "
            f"{(measured.peak_bytes + constants) / 0.9 / peak:.3f}); {len(lowest.regions)} regions"
        )
    policies = ("dtr", "dte", "coop", *(oracles(trace) if args.oracles else ()))
    for ratio in args.ratios:
        budget = int(ratio * peak)
        capacity = budget - int(0.1 * budget)
        print(f"ratio {ratio}: pool {capacity} B, beside op {index}: {capacity - total} B")
        for policy in policies:
            for limit in args.limits:
                print(f"  {policy}, thrash limit {limit:g}: {replay(trace, wants, capacity, policy, limit)}")
            limit = args.limits[0]  # the gradients not wanted at the end: evicted as any storage
            unmarked = replay(trace, (), capacity, policy, limit)
            print(f"  {policy}, thrash limit {limit:g}, no marks: {unmarked}")


if __name__ == "__main__":
    main()
