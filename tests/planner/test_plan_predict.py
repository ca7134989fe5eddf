"""The step-level prediction (``remat.planner.predict``) on small hand-built traces, where the
executor's behaviour can be followed by hand (NOTE [region model])."""

from __future__ import annotations

import dataclasses

import pytest

from remat.planner.cost_model import ExecutorCost, ExecutorWork
from remat.planner.predict import predict
from remat.planner.region_model import RegionOps
from remat.trace.builder import TraceBuilder
from remat.trace.types import Op, Phase, Trace


def _two_regions() -> Trace:
    """Region A (ops 0-2) makes h, which A's last op saves; region B (ops 3-6) reads h in an add
    that saves nothing, and saves the add's output o (1000 bytes each, z 4 bytes)."""
    b = TraceBuilder()
    x = b.tensor(100, constant=True)
    a, h, n, m, o, q = (b.tensor(1000) for _ in range(6))
    z = b.tensor(4)
    g1, g2, g3 = (b.tensor(1000) for _ in range(3))
    b.op("f", (x,), (a,), 1.0)  # 0 A
    b.op("g", (a,), (h,), 1.0)  # 1 A
    b.release(a)
    b.op("ln", (h,), (n,), 1.0)  # 2 A: saves its input h (position 2, inside A)
    b.op("mlp", (n,), (m,), 1.0)  # 3 B
    b.release(n)
    b.op("add", (h, m), (o,), 1.0)  # 4 B: reads h, saves nothing
    b.release(m)
    b.op("ln", (o,), (q,), 1.0)  # 5 B: saves o (position 5, inside B)
    b.op("sum", (q,), (z,), 1.0)  # 6 B
    b.release(q)
    b.op("ln_backward", (o, z), (g1,), 1.0, phase=Phase.BACKWARD)  # 7
    b.release(o)
    b.op("mm", (g1,), (g2,), 1.0, phase=Phase.BACKWARD)  # 8
    b.op("ln_backward", (h, g2), (g3,), 1.0, phase=Phase.BACKWARD)  # 9
    for t in (h, g1, g2, g3, z):
        b.release(t)
    return dataclasses.replace(b.trace("two regions"), saved=frozenset({h, o}), saved_at=((h, 2), (o, 5)))


def test_a_value_another_region_reads_stays_until_that_region_lets_go() -> None:
    """h is A's to recompute, so autograd does not hold it; but B's tape reads it, and B's replay
    plan needs it (and n) to make o again, so it stays until B's backward. Replaying B before op 7
    then has h, n, z and the replayed m and o alive: 4004 bytes."""
    trace = _two_regions()
    pred = predict(trace, [RegionOps((0, 1, 2)), RegionOps((3, 4, 5, 6))], ["A", "B"])
    assert pred.peak_bytes == 4004
    assert pred.peak_at == "op 7 ln_backward in (top level), replaying B"
    assert pred.recomputed == (frozenset({trace.ops[1].outputs[0]}), frozenset({trace.ops[4].outputs[0]}))
    assert pred.recompute_cost == 4.0  # g and f for A; add and mlp for B


def test_empty_regions_are_ignored() -> None:
    trace = _two_regions()
    assert predict(trace, [RegionOps(())]).peak_bytes == predict(trace, []).peak_bytes


def test_without_placed_saves_the_prediction_still_recomputes_the_region() -> None:
    trace = dataclasses.replace(_two_regions(), saved_at=())
    pred = predict(trace, [RegionOps((3, 4, 5, 6))], ["B"])
    assert pred.recomputed == (frozenset({trace.ops[4].outputs[0]}),)


def test_scratch_counts_where_the_op_runs_and_where_it_is_replayed() -> None:
    """A kernel's scratch buffer (``Op.scratch``) is live while the op runs, in the forward (beside
    h, n and m: 13000) and again when region B replays the op before op 7 (beside h, n, z and the
    replayed m: 13004)."""
    plain = _two_regions()
    ops = list(plain.events)
    i = next(k for k, e in enumerate(ops) if getattr(e, "index", None) == 3)  # mlp, in region B
    ops[i] = dataclasses.replace(ops[i], scratch=10_000)
    trace = dataclasses.replace(plain, events=tuple(ops))
    forward = predict(trace, [])
    assert (forward.peak_bytes, forward.peak_op) == (13_000, 3)
    replayed = predict(trace, [RegionOps((3, 4, 5, 6))], ["B"])
    assert (replayed.peak_bytes, replayed.peak_at) == (13_004, "op 7 ln_backward in (top level), replaying B")


def _in_modules(trace: Trace) -> Trace:
    """``trace`` with every forward op issued by a module, so the executor checks it."""
    events = tuple(
        dataclasses.replace(e, module="block") if isinstance(e, Op) and e.phase is Phase.FORWARD else e
        for e in trace.events
    )
    return dataclasses.replace(trace, events=events)


def test_the_executor_cost_adds_its_figure_per_op_it_counts() -> None:
    """NOTE [executor cost]: 7 forward ops checked, 7 recorded by A and B, 4 replayed (f and g for
    A, mlp and add for B), one storage offloaded; each figure adds exactly its count times itself,
    and nothing else moves."""
    trace = _in_modules(_two_regions())
    regions = [RegionOps((0, 1, 2)), RegionOps((3, 4, 5, 6))]
    o = trace.ops[4].outputs[0]
    plain = predict(trace, regions, moved=[(o, 5, 7)])
    assert plain.work == ExecutorWork(checked=7, recorded=7, replayed=4, moved=1)
    assert plain.executor_cost == 0.0
    for figures, seconds in (
        (ExecutorCost(check=1e-3), 7e-3),
        (ExecutorCost(record=1e-3), 7e-3),
        (ExecutorCost(replay=1e-3), 4e-3),
        (ExecutorCost(offload=1e-3), 1e-3),
        (ExecutorCost(1e-3, 1e-2, 1e-1, 1.0), 7e-3 + 7e-2 + 4e-1 + 1.0),
    ):
        pred = predict(trace, regions, moved=[(o, 5, 7)], executor=figures)
        assert pred.executor_cost == pytest.approx(seconds, rel=1e-12)
        assert pred.overhead == pytest.approx(plain.overhead + seconds / plain.base_cost, rel=1e-12)
        assert (pred.peak_bytes, pred.recompute_cost, pred.recomputed) == (
            plain.peak_bytes,
            plain.recompute_cost,
            plain.recomputed,
        )
    # with no region (or only modules run again) the forward runs bare after its first check
    alone = predict(trace, [], executor=ExecutorCost(1.0, 1.0, 1.0, 1.0))
    assert alone.work == ExecutorWork() and alone.executor_cost == 0.0
    moving = predict(trace, [], moved=[(o, 5, 7)], executor=ExecutorCost(1.0, 1.0, 1.0, 1.0))
    assert moving.work == ExecutorWork(checked=7, moved=1) and moving.executor_cost == 8.0


def test_of_two_plans_replaying_the_same_kernels_the_one_with_fewer_ops_is_cheaper() -> None:
    """A chain of ops, each output saved by the next op. Region [0, 1] replays ``f1`` (1.5) for
    t0; region [2, 5] replays ``p1 p2 p3`` (0.5 each) for t2, t3 and t4: the same kernel time, so
    the same prediction without the executor's figures; with a replay cost per op, the plan that
    replays one op is predicted cheaper than the one that replays three."""
    b = TraceBuilder()
    x = b.tensor(4, constant=True)
    t = [b.tensor(1000) for _ in range(6)]
    z, g = b.tensor(4), b.tensor(4)
    b.op("f1", (x,), (t[0],), 1.5)  # 0
    b.op("f2", (t[0],), (t[1],), 1.0)  # 1: saves t0
    b.op("p1", (t[1],), (t[2],), 0.5)  # 2: saves t1
    b.op("p2", (t[2],), (t[3],), 0.5)  # 3: saves t2
    b.op("p3", (t[3],), (t[4],), 0.5)  # 4: saves t3
    b.op("p4", (t[4],), (t[5],), 0.5)  # 5: saves t4
    b.op("sum", (t[5],), (z,), 0.1)  # 6
    b.op("backward", (*t[:5], z), (g,), 1.0, phase=Phase.BACKWARD)  # 7
    for v in (*t, z, g):
        b.release(v)
    saved = frozenset(t[:5])
    trace = _in_modules(
        dataclasses.replace(
            b.trace("chain"), saved=saved, saved_at=tuple((v, k + 1) for k, v in enumerate(t[:5]))
        )
    )
    few, many = [RegionOps((0, 1))], [RegionOps((2, 3, 4, 5))]
    kernels = [predict(trace, r) for r in (few, many)]
    assert kernels[0].recompute_cost == kernels[1].recompute_cost == 1.5
    assert kernels[0].overhead == kernels[1].overhead
    replay = ExecutorCost(replay=0.01)
    timed = [predict(trace, r, executor=replay) for r in (few, many)]
    assert (timed[0].work.replayed, timed[1].work.replayed) == (1, 3)
    assert timed[0].overhead < timed[1].overhead
