"""Tiny blocks in segments of their own: placement, addresses, freeing, and what they spare a run."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.core.driver import SEGMENTS_FROM, TINY, make_pool
from remat.core.pool import FREE, AddressPool, End, Fit
from remat.core.segments import SLOTS
from remat.sim import Outcome, simulate
from remat.sim.synthetic import Builder
from remat.trace.types import Phase, Trace


def test_tiny_blocks_share_one_segment_placed_from_their_end() -> None:
    pool = AddressPool(10_000, small=8)  # segments of 32 * 8 = 256 bytes
    assert pool.allocate(1, 1000) and pool.address(1) == 0
    assert pool.allocate(2, 8, End.HIGH) and pool.allocate(3, 4) and pool.allocate(4, 1000)
    segment_start = 10_000 - SLOTS * 8  # opened from the high end; 3 joins it, wherever it asked
    assert (pool.address(2), pool.address(3), pool.address(4)) == (segment_start, segment_start + 8, 1000)
    assert [owner for _, _, owner in pool.pieces()][:2] == [1, 4]  # the big blocks lie together
    assert pool.used == 2000 + SLOTS * 8 and pool.adjacent_free(2) == 0
    pool.transfer(3, 7)  # an in-place op's new version keeps the place
    assert pool.address(7) == segment_start + 8 and pool.holds(7) and not pool.holds(3)
    pool.free(2)
    assert pool.allocate(5, 6) and pool.address(5) == segment_start  # the first gap that holds it
    pool.free(5)
    pool.free(7)  # the segment's last block: the segment goes back to the pool
    assert pool.used == 2000 and pool.largest_free() == 8000
    assert pool.allocate(6, 8) and pool.address(6) == 2000  # from the low end: next to the others
    pool.check()


def test_a_tiny_block_goes_among_the_others_when_no_segment_fits() -> None:
    pool = AddressPool(300, small=8)
    assert pool.allocate(1, 100) and pool.allocate(2, 100)
    assert pool.allocate(3, 8)  # 100 bytes free, a segment needs 256
    assert pool.address(3) == 200 and pool.used == 208
    pool.check()


def test_a_sealed_segment_takes_no_new_block() -> None:
    pool = AddressPool(10_000, small=8)
    assert pool.allocate(1, 1000) and pool.allocate(2, 8)  # a constant and its segment, at 1000
    pool.seal()
    assert pool.allocate(3, 8) and pool.address(3) == 1000 + SLOTS * 8  # a new segment past it
    pool.free(2)
    assert pool.allocate(4, 8) and pool.address(4) == 1000 + SLOTS * 8 + 8
    pool.check()


def test_segments_move_whole_when_the_pool_is_compacted() -> None:
    pool = AddressPool(10_000, small=8)
    assert pool.allocate(1, 1000) and pool.allocate(2, 8) and pool.allocate(3, 8)
    pool.free(1)
    pool.compact()
    pool.check()
    assert (pool.address(2), pool.address(3)) == (0, 8)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 120), st.sampled_from(list(End))), max_size=80))
def test_random_sequences_never_overlap(ops: list[tuple[bool, int, End]]) -> None:
    pool = AddressPool(2000, Fit.BEST, small=4)
    held: dict[int, int] = {}
    for owner, (allocate, size, end) in enumerate(ops):
        if allocate or not held:
            if pool.allocate(owner, size, end):
                held[owner] = size
        else:
            victim = sorted(held)[size % len(held)]
            pool.free(victim)
            del held[victim]
        pool.check()
        spans = sorted((pool.address(o), pool.address(o) + n) for o, n in held.items())
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
        assert sum(held.values()) <= pool.used <= pool.capacity


def counter_chain(layers: int = 12, size: int = 2**23) -> Trace:
    """A chain whose every layer also bumps a tiny constant in place, as batch norm does with
    ``num_batches_tracked``: each bump makes a new 8-byte version that stays (NOTE [constants
    stay] in remat/core/runtime.py)."""
    p = Builder()
    x = p.tensor(size, constant=True)
    counter = p.tensor(8, constant=True)
    saved = []
    for _ in range(layers):
        a = p.tensor(size)
        p.op("conv", (x,), (a,), size * 8e-9)
        p.op("add_", (counter,), (), 1e-9, mutates=(counter,))
        saved.append(a)
        x = a
    grad = p.tensor(size)
    p.op("ones_like", (x,), (grad,), 1e-9, phase=Phase.BACKWARD)
    for a in reversed(saved):
        wide = p.tensor(2 * size)
        p.op("conv_backward", (grad, a), (wide,), size * 16e-9, phase=Phase.BACKWARD)
        p.release(a)
        p.release(grad)
        grad = p.tensor(size)
        p.op("narrow", (wide,), (grad,), 1e-9, phase=Phase.BACKWARD)
        p.release(wide)
    return p.trace("counter-chain")


def test_tiny_constants_no_longer_split_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = counter_chain()
    assert 0.6 * trace.peak_bytes >= SEGMENTS_FROM
    with_segments = simulate(trace, 0.6, "dtr")
    assert with_segments.outcome is Outcome.OK
    # The same run in a pool that places every block by best fit: the 8-byte versions land
    # between the activations, and the backward's double-width gradients find no room.
    module = sys.modules["remat.sim.simulate"]
    monkeypatch.setattr(module, "make_pool", lambda capacity, layout, fit: AddressPool(capacity, Fit(fit)))
    assert simulate(trace, 0.6, "dtr").outcome is Outcome.OOM


def test_small_pools_have_no_segments() -> None:
    small = make_pool(SEGMENTS_FROM - 1, True)
    assert isinstance(small, AddressPool) and small.segments is None
    large = make_pool(SEGMENTS_FROM, True)  # a pool of addresses only: nothing is allocated
    assert isinstance(large, AddressPool) and large.segments is not None and large.segments.small == TINY
    assert [owner for _, _, owner in large.pieces()] == [FREE]
