"""Packing a pool whose addresses are a model before the callers' locks are dropped (NOTE [relaxed
locks] in :mod:`remat.core.runtime`), on a hand-written program."""

from __future__ import annotations

from remat.core.graph import Record
from remat.core.policies import get
from remat.core.pool import AddressPool
from remat.core.runtime import Runtime
from remat.sim.backend import SimBackend, drive
from remat.sim.synthetic import Builder
from remat.trace.types import Trace


class Recording(SimBackend):
    """The simulator's backend, remembering the ops recomputed, in order."""

    def __init__(self) -> None:
        super().__init__(1.0, 0, 100.0)
        self.recomputed: list[str] = []

    def materialize(self, record: Record, recompute: bool) -> float:
        if recompute:
            self.recomputed.append(record.op.name)
        return super().materialize(record, recompute)


def _run(trace: Trace, pool: AddressPool, compact: bool = False) -> tuple[Runtime, Recording]:
    backend = Recording()
    runtime = Runtime(pool, get("lru"), backend, compact=compact)
    drive(runtime, trace, backend, finish=False)
    return runtime, backend


def fragmented() -> Trace:
    """k(a, b, w1, w2) with b evicted and its parent q dead; the free bytes lie in pieces between
    a, w1 and w2, none of which may move while k gathers."""
    p = Builder()
    x = p.tensor(1, constant=True)
    q, b = p.tensor(8), p.tensor(8)
    p.op("q", (x,), (q,), 1.0)
    p.op("b", (q,), (b,), 1.0)
    p.release(q)
    a = p.tensor(8)
    p.op("a", (x,), (a,), 1.0)
    w1, z1, w2, z2 = p.tensor(4), p.tensor(4), p.tensor(4), p.tensor(4)
    for name, t in (("w1", w1), ("z1", z1), ("w2", w2), ("z2", z2)):
        p.op(name, (x,), (t,), 1.0)
    p.release(z1)
    p.release(z2)
    y = p.tensor(8)
    p.op("y", (x,), (y,), 1.0)  # pushes b out
    p.release(y)
    k = p.tensor(1)
    p.op("k", (a, b, w1, w2), (k,), 1.0)
    return p.trace("fragmented")


def test_model_addresses_are_packed_before_the_callers_inputs_are_given_up() -> None:
    runtime, backend = _run(fragmented(), AddressPool(35), compact=True)
    assert backend.recomputed == ["q", "b"]  # a, k's own input, stays
    assert runtime.telemetry.evictions == 1  # b, for y
