"""The step-level prediction (``remat.planner.predict``) on small hand-built traces, where the
executor's behaviour can be followed by hand (NOTE [region model])."""

from __future__ import annotations

import dataclasses

from remat.planner.predict import predict
from remat.planner.region_model import RegionOps
from remat.trace.builder import TraceBuilder
from remat.trace.types import Phase, Trace


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
