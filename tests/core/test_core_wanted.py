"""Storages wanted at the program's end (NOTE [wanted at the end] in ``remat.core.residency``): kept
out of the policies' reach, evicted only as a last resort, and marked again at the same moments
when another run replays the recorded marks."""

from __future__ import annotations

from remat.core.policies import get
from remat.core.pool import AddressPool, BytePool
from remat.core.runtime import Runtime
from remat.dynamic.stats import Recorder
from remat.sim.backend import SimBackend, drive
from remat.sim.synthetic import Builder
from remat.trace.types import Trace

GRADIENT_AT = 2
"""Ops run before the gradient of :func:`step` is marked: it is made by op 1."""


def step(accumulate: bool = False) -> tuple[Trace, int]:
    """A forward chain ``a -> f0 .. f3`` and a backward over it in reverse; ``g`` (made from ``a``
    early, never read again) is held to the end, as a parameter's gradient is. ``accumulate``: a
    last op adds into ``g`` in place, as a second backward would."""
    p = Builder()
    x = p.tensor(10, constant=True)
    a = p.tensor(10)
    p.op("a", (x,), (a,), 1.0)
    g = p.tensor(10)
    p.op("g", (a,), (g,), 1.0)
    previous, made = a, []
    for i in range(4):
        made.append(p.tensor(10))
        p.op(f"f{i}", (previous,), (made[-1],), 1.0)
        previous = made[-1]
    p.release(a)
    for i, t in enumerate(reversed(made)):
        u = p.tensor(10)
        p.op(f"b{i}", (t,), (u,), 1.0)
        p.release(t)
        p.release(u)
    if accumulate:
        p.op("add_", (g, x), (), 1.0, mutates=(g,))
    return p.trace("step"), g


def run(trace: Trace, capacity: int, wants: list[tuple[int, int]]) -> tuple[Runtime, int, list[int]]:
    """The runtime after ``trace`` and its hand-over, the recomputations of the hand-over, and the
    victims in order."""
    backend = SimBackend(1.0, 0, 100.0)
    recorder = Recorder(get("lru"))
    runtime = Runtime(BytePool(capacity), recorder, backend)
    runtime.expect(wants)
    drive(runtime, trace, backend, finish=False)
    before = runtime.telemetry.recomputations
    runtime.finish()
    return runtime, runtime.telemetry.recomputations - before, recorder.victims


def test_a_wanted_storage_is_not_evicted_and_the_hand_over_recomputes_nothing() -> None:
    trace, g = step()
    plain, at_end, victims = run(trace, 60, [])
    assert at_end == 2  # the stalest storage, evicted; restoring it needs ``a`` again
    assert plain.storage_of(g) in victims
    runtime, at_end, victims = run(trace, 60, [(GRADIENT_AT, g)])
    assert at_end == 0
    assert runtime.storage_of(g) not in victims and victims  # others went instead
    assert runtime.wants == [(GRADIENT_AT, g)]
    assert runtime.telemetry.peak_bytes <= 60 and plain.telemetry.peak_bytes <= 60


def test_a_wanted_storage_is_evicted_as_a_last_resort() -> None:
    trace, g = step()
    runtime, at_end, victims = run(trace, 30, [(GRADIENT_AT, g)])  # nothing else can make room
    assert at_end == 2 and runtime.storage_of(g) in victims
    assert runtime.telemetry.peak_bytes <= 30
    assert runtime.wanted[runtime.storage_of(g)]  # hidden from the policy again once restored
    assert not runtime.evictable.values[runtime.storage_of(g)]


def test_the_mark_follows_an_in_place_write_and_ends_with_the_last_handle() -> None:
    trace, g = step(accumulate=True)
    runtime, at_end, _ = run(trace, 60, [(GRADIENT_AT, g)])
    assert at_end == 0
    first = runtime.graph.records[1].outputs[0]
    latest = runtime.storage_of(g)
    assert latest != first and runtime.wanted[latest] and not runtime.wanted[first]
    runtime.release(g)
    assert not runtime.wanted[latest]


def test_where_addresses_are_a_model_a_wanted_block_moves_out_of_the_way() -> None:
    p = Builder()
    x = p.tensor(10, constant=True)
    a, g, b = p.tensor(10), p.tensor(10), p.tensor(10)
    p.op("a", (x,), (a,), 1.0)
    p.op("g", (a,), (g,), 1.0)
    p.release(a)  # a hole below g
    p.op("b", (x,), (b,), 1.0)  # marked before this op runs, g moves down into a's hole
    backend = SimBackend(1.0, 0, 100.0)
    runtime = Runtime(AddressPool(100), get("lru"), backend, compact=True)
    runtime.expect([(GRADIENT_AT, g)])
    drive(runtime, p.trace("hole"), backend, finish=False)
    pool = runtime.pool
    assert isinstance(pool, AddressPool)
    assert pool.address(runtime.storage_of(g)) == 10  # right after the constant, where a was
    assert pool.address(runtime.storage_of(b)) == 20


def test_the_last_resort_never_evicts_a_constant() -> None:
    p = Builder()
    x, y = p.tensor(10, constant=True), p.tensor(10, constant=True)
    a, b = p.tensor(10), p.tensor(10)
    p.op("a", (x,), (a,), 1.0)
    p.op("b", (y,), (b,), 1.0)  # no room beside x, y and a: a goes, x (staler, wanted too) stays
    backend = SimBackend(1.0, 0, 100.0)
    recorder = Recorder(get("lru"))
    runtime = Runtime(BytePool(30), recorder, backend)
    runtime.expect([(0, x), (1, a)])
    drive(runtime, p.trace("constant"), backend, finish=False)
    assert recorder.victims == [runtime.storage_of(a)]
    assert runtime.resident[runtime.storage_of(x)] and runtime.wanted[runtime.storage_of(x)]
