"""The memory pool: a fixed range of addresses carved into allocated and free blocks.

DTR counts bytes: an allocation fits when the resident bytes plus the request stay under the budget.
A real caching allocator needs one *contiguous* free block, and freeing 60 MB here and 40 MB there
does not make room for 100 MB. :class:`AddressPool` models the addresses, so that fragmentation, and
the layout-aware eviction that avoids it (Coop), can be simulated; :class:`BytePool` is the byte
counting model of the DTR simulator, kept to reproduce its numbers. Both answer the same questions
(:class:`Pool`); only the address pool can list its pieces.

The pieces are kept in address order in flat arrays (numpy reads them without a copy, for the
vectorized window search of Coop); free pieces are also kept sorted by (size, address) for best fit.
Placing and freeing are O(log n) searches plus one O(n) memory move, done in C.
"""

from __future__ import annotations

import bisect
import enum
from array import array
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from remat.core.segments import Segments

FREE = -1
"""Owner of a free piece in :meth:`AddressPool.pieces`."""


class End(enum.Enum):
    """Which end of the pool an allocation is placed from."""

    LOW = "low"
    HIGH = "high"


class Fit(enum.StrEnum):
    """How the free block for an allocation is chosen."""

    BEST = "best"  # the smallest block that fits (ties: nearest to the chosen end)
    FIRST = "first"  # the first block that fits, scanning from the chosen end


class OutOfMemory(Exception):
    """An allocation cannot fit even with every evictable storage evicted. ``whole``: ``request``
    is a set that must be resident at once, checked before anything runs (an op's inputs and
    outputs, what the program holds at its end), not one allocation of a recomputation."""

    def __init__(self, request: int, pinned: int, capacity: int, layout: bool, whole: bool = False) -> None:
        self.request, self.pinned, self.capacity = request, pinned, capacity
        self.needed = request + pinned
        self.whole = whole
        where = "contiguous " if layout else ""
        super().__init__(
            f"no {where}room for {request} bytes: {pinned} bytes are pinned or constant "
            f"and the pool holds {capacity}"
        )


class Pool(Protocol):
    """What the rematerialization core asks of memory."""

    capacity: int
    layout: bool

    @property
    def used(self) -> int: ...

    def allocate(self, owner: int, nbytes: int, end: End = End.LOW) -> bool: ...

    def free(self, owner: int) -> None: ...

    def transfer(self, owner: int, new_owner: int) -> None: ...

    def adjacent_free(self, owner: int) -> int: ...

    def largest_free(self) -> int: ...

    def holds(self, owner: int) -> bool: ...

    def compact(self) -> None: ...

    def lower(self, owner: int) -> None: ...


class BytePool:
    """Byte counting: an allocation fits when ``used + nbytes <= capacity``. No addresses."""

    layout = False

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._sizes: dict[int, int] = {}
        self._used = 0

    @property
    def used(self) -> int:
        return self._used

    def allocate(self, owner: int, nbytes: int, end: End = End.LOW) -> bool:
        if self._used + nbytes > self.capacity:
            return False
        self._sizes[owner] = nbytes
        self._used += nbytes
        return True

    def free(self, owner: int) -> None:
        self._used -= self._sizes.pop(owner)

    def transfer(self, owner: int, new_owner: int) -> None:
        self._sizes[new_owner] = self._sizes.pop(owner)

    def holds(self, owner: int) -> bool:
        """Whether ``owner`` has bytes in the pool."""
        return owner in self._sizes

    def compact(self) -> None:
        """Nothing to move: bytes have no places."""

    def lower(self, owner: int) -> None:
        """Nothing to move: bytes have no places."""

    def adjacent_free(self, owner: int) -> int:
        return 0

    def largest_free(self) -> int:
        return self.capacity - self._used


class AddressPool:
    """``capacity`` bytes of addresses; allocations are placed from either end, best or first fit.
    With ``small`` > 0, allocations of at most ``small`` bytes are packed into segments
    (:mod:`remat.core.segments`), each one block of the pool placed like any block of its size, from
    the end the allocation asks for (the low end for constants: the first segment lies next to
    them, so that the blocks placed before an arena exists stay one run from address 0, as
    ``remat.dynamic``'s arena backend needs); where no piece holds a segment, a tiny block is
    placed like any other."""

    layout = True

    def __init__(self, capacity: int, fit: Fit = Fit.BEST, small: int = 0) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.fit = Fit(fit)
        self.segments = Segments(small) if small > 0 else None
        # The pieces, in address order; array('q') so that numpy can view them without a copy.
        self._starts = array("q", [0])
        self._sizes = array("q", [capacity])
        self._owners = array("q", [FREE])
        self._start_of: dict[int, int] = {}  # owner -> start address
        self._free_sorted: list[tuple[int, int]] = [(capacity, 0)]  # (size, start) of free pieces
        self._used = 0

    @property
    def used(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used

    def address(self, owner: int) -> int:
        segments = self.segments
        if segments is not None and segments.holds(owner):
            segment, offset = segments.locate(owner)
            return self._start_of[segment] + offset
        return self._start_of[owner]

    def holds(self, owner: int) -> bool:
        """Whether ``owner`` has a block in the pool."""
        return owner in self._start_of or (self.segments is not None and self.segments.holds(owner))

    def largest_free(self) -> int:
        return self._free_sorted[-1][0] if self._free_sorted else 0

    def seal(self) -> None:
        """Blocks placed from now on never join the segments there are now (an arena that covers
        only the addresses past what is placed now must not find its blocks below them)."""
        if self.segments is not None:
            self.segments.seal()

    def compact(self) -> None:
        """Move every block down, in address order, so that the free bytes are one block at the
        high end: for a pool whose addresses are a model of the memory, not the memory itself."""
        blocks = [(size, owner) for _, size, owner in self.pieces() if owner != FREE]
        self._starts, self._sizes, self._owners = array("q"), array("q"), array("q")
        self._start_of.clear()
        position = 0
        for size, owner in blocks:
            self._insert(len(self._starts), position, size, owner)
            self._start_of[owner] = position
            position += size
        self._free_sorted = []
        if position < self.capacity:
            self._insert(len(self._starts), position, self.capacity - position, FREE)
            self._free_sorted.append((self.capacity - position, position))

    def fragmentation(self) -> float:
        """1 - largest free block / free bytes: 0 when all free memory is one block."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free() / free

    def allocate(self, owner: int, nbytes: int, end: End = End.LOW) -> bool:
        """Place ``nbytes`` for ``owner``; False (and no change) when no free block is large enough."""
        if nbytes <= 0:
            raise ValueError(f"allocations must be positive, got {nbytes} bytes")
        if self.holds(owner):
            raise ValueError(f"owner {owner} already holds a block")
        segments = self.segments
        if segments is not None and segments.tiny(nbytes):
            if segments.place(owner, nbytes):
                return True
            segment = segments.open()
            if self._place(segment, segments.size, end):
                return segments.place(owner, nbytes)
            segments.close(segment)  # no room for a segment: the block goes among the others
        return self._place(owner, nbytes, end)

    def _place(self, owner: int, nbytes: int, end: End, fit: Fit | None = None) -> bool:
        chosen = self._choose(nbytes, end, fit or self.fit)
        if chosen is None:
            return False
        self._take(owner, nbytes, end, chosen)
        return True

    def _take(self, owner: int, nbytes: int, end: End, chosen: tuple[int, int]) -> None:
        """Place ``nbytes`` for ``owner`` in free piece ``chosen`` (its size and start)."""
        size, start = chosen
        self._free_sorted.remove(chosen)
        i = self._index(start)
        rest = size - nbytes
        if rest == 0:
            self._owners[i] = owner
            placed = start
        elif end is End.LOW:
            self._sizes[i], self._owners[i] = nbytes, owner
            self._insert(i + 1, start + nbytes, rest, FREE)
            bisect.insort(self._free_sorted, (rest, start + nbytes))
            placed = start
        else:
            self._sizes[i] = rest
            bisect.insort(self._free_sorted, (rest, start))
            placed = start + rest
            self._insert(i + 1, placed, nbytes, owner)
        self._start_of[owner] = placed
        self._used += nbytes

    def free(self, owner: int) -> None:
        """Return ``owner``'s block and merge it with free neighbours (a segment goes back to the
        pool once its last tiny block is freed)."""
        segments = self.segments
        if segments is not None and segments.holds(owner):
            segment, _, empty = segments.remove(owner)
            if empty:
                segments.close(segment)
                self.free(segment)
            return
        i = self._index(self._start_of.pop(owner))
        sizes, owners = self._sizes, self._owners
        self._used -= sizes[i]
        owners[i] = FREE
        if i + 1 < len(sizes) and owners[i + 1] == FREE:
            self._free_sorted.remove((sizes[i + 1], self._starts[i + 1]))
            sizes[i] += sizes[i + 1]
            self._delete(i + 1)
        if i > 0 and owners[i - 1] == FREE:
            self._free_sorted.remove((sizes[i - 1], self._starts[i - 1]))
            sizes[i - 1] += sizes[i]
            self._delete(i)
            i -= 1
        bisect.insort(self._free_sorted, (sizes[i], self._starts[i]))

    def lower(self, owner: int) -> None:
        """Move ``owner``'s block down into the smallest free piece below it that holds it, if any:
        out of the way of later allocations, for a block that stays (only where the addresses are
        a model, as :meth:`compact`; NOTE [wanted at the end] in ``remat.core.residency``)."""
        if self.segments is not None and self.segments.holds(owner):
            return
        start = self._start_of[owner]
        nbytes = self._sizes[self._index(start)]
        below = [(size, at) for size, at in self._free_sorted if size >= nbytes and at < start]
        if below:
            at = min(below)[1]  # the smallest (best fit); freeing the block may grow it upwards
            self.free(owner)
            self._take(owner, nbytes, End.LOW, (self._sizes[self._index(at)], at))

    def transfer(self, owner: int, new_owner: int) -> None:
        """Hand ``owner``'s block to ``new_owner`` unchanged (an in-place op's new version)."""
        if self.segments is not None and self.segments.holds(owner):
            self.segments.transfer(owner, new_owner)
            return
        start = self._start_of.pop(owner)
        self._owners[self._index(start)] = new_owner
        self._start_of[new_owner] = start

    def adjacent_free(self, owner: int) -> int:
        """Free bytes directly below and above ``owner``'s block (they coalesce if it is freed; none
        for a block in a segment)."""
        if self.segments is not None and self.segments.holds(owner):
            return 0
        i = self._index(self._start_of[owner])
        total = 0
        for j in (i - 1, i + 1):
            if 0 <= j < len(self._sizes) and self._owners[j] == FREE:
                total += self._sizes[j]
        return total

    def adjacent_free_all(self, owners: int) -> np.ndarray:
        """:meth:`adjacent_free` of every owner in ``range(owners)`` at once (0 where none)."""
        sizes, held = self.arrays()
        free = np.where(held == FREE, sizes, 0)
        around = np.concatenate(([0], free[:-1])) + np.concatenate((free[1:], [0]))
        out = np.zeros(owners + 1, dtype=np.int64)
        out[np.where((held >= 0) & (held < owners), held, owners)] = around
        return out[:owners]

    def pieces(self) -> Iterator[tuple[int, int, int]]:
        """``(start, size, owner)`` of every block in address order; free blocks have owner FREE."""
        return zip(self._starts, self._sizes, self._owners, strict=True)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Sizes and owners of the pieces in address order, as numpy views (valid until the pool
        changes)."""
        return np.frombuffer(self._sizes, dtype=np.int64), np.frombuffer(self._owners, dtype=np.int64)

    def check(self) -> None:
        """Assert the invariants (blocks tile the range, free blocks coalesced, counts exact)."""
        position, used, previous_free = 0, 0, False
        for start, size, owner in self.pieces():
            assert start == position and size > 0, (start, position, size)
            assert not (previous_free and owner == FREE), "adjacent free blocks were not coalesced"
            assert owner == FREE or self._start_of[owner] == start
            previous_free = owner == FREE
            used += 0 if owner == FREE else size
            position += size
        assert position == self.capacity and used == self._used
        free = sorted((size, start) for start, size, owner in self.pieces() if owner == FREE)
        assert free == self._free_sorted
        if self.segments is not None:
            ends: dict[int, int] = {}
            for segment, offset, size, owner in self.segments.blocks():
                assert segment in self._start_of and offset >= ends.get(segment, 0), (segment, owner)
                assert self.segments.locate(owner) == (segment, offset)
                ends[segment] = offset + size
                assert ends[segment] <= self.segments.size

    def _choose(self, nbytes: int, end: End, fit: Fit) -> tuple[int, int] | None:
        """The (size, start) of the free piece to place ``nbytes`` in."""
        free = self._free_sorted
        if fit is Fit.BEST:
            i = bisect.bisect_left(free, (nbytes, -1))
            if i == len(free):
                return None
            if end is End.HIGH:  # the highest-addressed piece among the equally small ones
                i = bisect.bisect_right(free, (free[i][0], self.capacity)) - 1
            return free[i]
        fitting = [(start, size) for size, start in free if size >= nbytes]
        if not fitting:
            return None
        start, size = max(fitting) if end is End.HIGH else min(fitting)
        return size, start

    def _index(self, start: int) -> int:
        return bisect.bisect_left(self._starts, start)

    def _insert(self, i: int, start: int, size: int, owner: int) -> None:
        self._starts.insert(i, start)
        self._sizes.insert(i, size)
        self._owners.insert(i, owner)

    def _delete(self, i: int) -> None:
        del self._starts[i], self._sizes[i], self._owners[i]
