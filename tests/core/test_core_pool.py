"""The memory pools: placement from both ends, best and first fit, coalescing, exact accounting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.core.pool import FREE, AddressPool, BytePool, End, Fit


def layout(pool: AddressPool) -> list[tuple[int, int, int]]:
    return list(pool.pieces())


def test_low_and_high_ends() -> None:
    pool = AddressPool(100)
    assert pool.allocate(1, 10, End.LOW) and pool.address(1) == 0
    assert pool.allocate(2, 20, End.HIGH) and pool.address(2) == 80
    assert pool.allocate(3, 5, End.LOW) and pool.address(3) == 10
    assert layout(pool) == [(0, 10, 1), (10, 5, 3), (15, 65, FREE), (80, 20, 2)]
    assert (pool.used, pool.free_bytes, pool.largest_free()) == (35, 65, 65)
    pool.check()


def test_free_coalesces_both_neighbours() -> None:
    pool = AddressPool(30)
    for owner in (1, 2, 3):
        pool.allocate(owner, 10)
    pool.free(1)
    pool.free(3)
    assert pool.fragmentation() == pytest.approx(0.5)  # two 10-byte holes: largest is half the free bytes
    assert not pool.allocate(4, 20)  # 20 bytes are free, but not in one piece
    pool.free(2)
    assert layout(pool) == [(0, 30, FREE)]
    assert pool.fragmentation() == 0.0
    pool.check()


def test_best_fit_takes_the_smallest_hole_first_fit_the_first() -> None:
    def holes(fit: Fit) -> AddressPool:
        pool = AddressPool(100, fit)
        for owner, size in enumerate((30, 10, 20, 5, 35), start=1):
            pool.allocate(owner, size)
        pool.free(1)  # hole of 30 at 0
        pool.free(3)  # hole of 20 at 40
        return pool

    best, first = holes(Fit.BEST), holes(Fit.FIRST)
    best.allocate(9, 15)
    first.allocate(9, 15)
    assert best.address(9) == 40 and first.address(9) == 0
    first_high = holes(Fit.FIRST)
    first_high.allocate(9, 15, End.HIGH)
    assert first_high.address(9) == 60 - 15  # the highest hole that fits, at its top


def test_adjacent_free_and_transfer() -> None:
    pool = AddressPool(40)
    for owner in (1, 2, 3, 4):
        pool.allocate(owner, 10)
    pool.free(1)
    pool.free(3)
    assert pool.adjacent_free(2) == 20 and pool.adjacent_free(4) == 10
    assert list(pool.adjacent_free_all(5)) == [0, 0, 20, 0, 10]
    pool.transfer(2, 7)  # an in-place op's new version takes the block over
    assert pool.address(7) == 10 and pool.used == 20
    with pytest.raises(KeyError):
        pool.address(2)


def test_refuses_bad_requests() -> None:
    pool = AddressPool(10)
    with pytest.raises(ValueError, match="positive"):
        pool.allocate(1, 0)
    pool.allocate(1, 5)
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate(1, 5)
    assert not pool.allocate(2, 6)
    with pytest.raises(ValueError, match="positive"):
        AddressPool(0)


def test_byte_pool_counts_bytes_only() -> None:
    pool = BytePool(30)
    assert pool.allocate(1, 10) and pool.allocate(2, 10) and pool.allocate(3, 10)
    pool.free(1)
    pool.free(3)
    assert pool.allocate(4, 20)  # no addresses: 20 free bytes hold 20 bytes
    assert (pool.used, pool.largest_free(), pool.adjacent_free(4)) == (30, 0, 0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(1, 40), st.sampled_from(list(End))), min_size=1, max_size=60
    ),
    st.sampled_from(list(Fit)),
)
def test_random_sequences_keep_invariants(ops: list[tuple[bool, int, End]], fit: Fit) -> None:
    pool = AddressPool(100, fit)
    held: dict[int, int] = {}
    for owner, (allocate, size, end) in enumerate(ops):
        if allocate or not held:
            fits = max((s for _, s, o in pool.pieces() if o == FREE), default=0) >= size
            assert pool.allocate(owner, size, end) == fits  # fails exactly when no free block is large enough
            if fits:
                held[owner] = size
        else:
            victim = sorted(held)[size % len(held)]
            pool.free(victim)
            del held[victim]
        pool.check()
        assert pool.used == sum(held.values()) <= pool.capacity
        assert pool.free_bytes == pool.capacity - pool.used


def test_compact_packs_the_blocks_and_leaves_one_free_piece() -> None:
    pool = AddressPool(100)
    for owner in range(5):
        assert pool.allocate(owner, 20)
    pool.free(1)
    pool.free(3)
    assert not pool.allocate(9, 30)  # 40 bytes free, in two pieces
    pool.compact()
    pool.check()
    assert [(start, owner) for start, _, owner in pool.pieces()][:3] == [(0, 0), (20, 2), (40, 4)]
    assert pool.largest_free() == 40 and pool.used == 60
    assert pool.allocate(9, 30)


def test_lower_moves_a_block_into_the_smallest_piece_below_it_that_holds_it() -> None:
    pool = AddressPool(80)
    for owner in range(6):
        assert pool.allocate(owner, 10)
    pool.free(0)
    pool.free(1)  # [free 20][2][free 10][4][5][free 20]
    pool.free(3)
    pool.lower(5)  # the smallest piece below that holds it: where 3 was, not address 0
    assert pool.address(5) == 30
    pool.check()
    pool.lower(4)  # only the piece at 0 is below it now
    assert pool.address(4) == 0
    pool.lower(2)  # what 4 left of that piece
    assert pool.address(2) == 10
    pool.lower(4)  # nothing free below it
    assert pool.address(4) == 0 and pool.used == 30
    pool.check()
    tiny = AddressPool(4096, small=8)
    assert tiny.allocate(7, 8)
    place = tiny.address(7)
    tiny.lower(7)  # in a segment: it stays
    assert tiny.address(7) == place
