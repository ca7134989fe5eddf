"""NOTE [unfilled results] in :mod:`remat.core.residency`: an ``empty`` op's result is never
evicted (C++ code may fill it through its data pointer between later ops), and an op that writes
it makes a new version that is evictable as any other. On hand-written programs."""

from __future__ import annotations

from test_core_relaxed import Recording

from remat.core.policies import get
from remat.core.pool import BytePool
from remat.core.runtime import Runtime
from remat.sim.backend import drive
from remat.sim.synthetic import Builder
from remat.trace.types import Trace


def _program(first: str, write: bool) -> Trace:
    """``first`` makes the oldest tensor ``e`` (optionally written in place next), ``a`` comes
    next, and ``b`` needs one of them evicted; then an op reads ``e`` and ``a``. LRU's victim is
    ``e``, the stalest, unless it may not go."""
    p = Builder()
    x = p.tensor(1, constant=True)
    e = p.tensor(8)
    p.op(first, (x,), (e,), 1.0)
    if write:
        p.op("aten.fill_.Scalar", (e,), (), 1.0, mutates=(e,))
    a, b, c = p.tensor(8), p.tensor(8), p.tensor(1)
    p.op("aten.relu.default", (x,), (a,), 1.0)
    p.op("aten.sin.default", (x,), (b,), 1.0)
    p.release(b)
    p.op("aten.add.Tensor", (e, a), (c,), 1.0)
    return p.trace("unfilled")


def _run(trace: Trace) -> tuple[Runtime, Recording]:
    backend = Recording()
    runtime = Runtime(BytePool(24), get("lru"), backend)
    drive(runtime, trace, backend, finish=False)
    return runtime, backend


def test_an_empty_ops_result_is_never_evicted() -> None:
    runtime, backend = _run(_program("aten.empty.memory_format", write=False))
    assert "aten.empty.memory_format" not in backend.recomputed
    assert backend.recomputed == ["aten.relu.default"]  # a went instead
    filled, backend = _run(_program("aten.zeros.default", write=False))  # a value of its own: evicted
    assert backend.recomputed == ["aten.zeros.default"]


def test_a_version_an_op_wrote_is_evictable() -> None:
    backend = Recording()
    runtime = Runtime(BytePool(100), get("lru"), backend)
    drive(runtime, _program("aten.empty.memory_format", write=True), backend, finish=False)
    written = runtime.storage_of(1)  # e, after fill_ wrote it
    assert written not in runtime.pinned and runtime.evictable.values[written]
    assert not runtime.pinned  # the empty's version went with its last handle: nothing stays pinned
