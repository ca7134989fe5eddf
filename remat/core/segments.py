"""Segments: tiny blocks packed together inside blocks of the address pool, apart from the rest.

A best-fit pool puts an 8-byte block in the smallest hole that holds it, anywhere: between two
activations, at the edge of a hole a large tensor will need. A tiny block that never leaves (a new
version of a constant, such as batch norm's ``num_batches_tracked`` after each ``add_``) then splits
the evictable memory for good, and no eviction can make a contiguous run across it (U-Net in
benchmarks/sim/README.md, "Tiny blocks"). PyTorch's caching allocator serves small requests from
segments of their own; :class:`Segments` does the same for :class:`~remat.core.pool.AddressPool`:
blocks of at most ``small`` bytes share segments of :data:`SLOTS` ``* small`` bytes, each held by
the pool as one block, so that tiny blocks split the pool once per segment instead of once each.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

SLOTS = 32
"""A segment holds this many blocks of the largest tiny size."""

_SEGMENT_OWNERS = -(2**61)


class Segments:
    """Where tiny blocks lie: which segment, at which offset. The pool places the segments."""

    def __init__(self, small: int) -> None:
        if small <= 0:
            raise ValueError(f"the tiny size must be positive, got {small}")
        self.small = small
        self.size = SLOTS * small
        self._blocks: dict[int, list[tuple[int, int, int]]] = {}  # segment -> (offset, size, owner)
        self._where: dict[int, tuple[int, int]] = {}  # owner -> (segment, offset)
        self._sealed: set[int] = set()  # segments no new block joins
        self._opened = 0

    def tiny(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` goes to a segment."""
        return nbytes <= self.small

    def holds(self, owner: int) -> bool:
        return owner in self._where

    def place(self, owner: int, nbytes: int) -> bool:
        """Put ``owner`` in the first gap of ``nbytes`` of the oldest open segment that has one."""
        for segment, blocks in self._blocks.items():
            if segment in self._sealed:
                continue
            position = 0
            for i, (offset, size, _) in enumerate(blocks):
                if offset - position >= nbytes:
                    self._put(segment, i, position, nbytes, owner)
                    return True
                position = offset + size
            if self.size - position >= nbytes:
                self._put(segment, len(blocks), position, nbytes, owner)
                return True
        return False

    def open(self) -> int:
        """A new, empty segment; returns its owner number in the pool (negative, apart from every
        owner the runtime uses)."""
        segment = _SEGMENT_OWNERS - self._opened
        self._opened += 1
        self._blocks[segment] = []
        return segment

    def close(self, segment: int) -> None:
        """Forget an empty segment (the pool no longer holds it)."""
        assert not self._blocks.pop(segment)
        self._sealed.discard(segment)

    def seal(self) -> None:
        """No new block joins the segments there are now; later tiny blocks open new ones."""
        self._sealed.update(self._blocks)

    def remove(self, owner: int) -> tuple[int, int, bool]:
        """Take ``owner`` out; returns its segment, its size, and whether the segment is now empty."""
        segment, offset = self._where.pop(owner)
        blocks = self._blocks[segment]
        i = bisect.bisect_left(blocks, (offset,))
        size = blocks.pop(i)[1]
        return segment, size, not blocks

    def transfer(self, owner: int, new_owner: int) -> None:
        segment, offset = self._where.pop(owner)
        self._where[new_owner] = segment, offset
        blocks = self._blocks[segment]
        i = bisect.bisect_left(blocks, (offset,))
        blocks[i] = (offset, blocks[i][1], new_owner)

    def locate(self, owner: int) -> tuple[int, int]:
        """``owner``'s segment and its offset there."""
        return self._where[owner]

    def blocks(self) -> Iterator[tuple[int, int, int, int]]:
        """``(segment, offset, size, owner)`` of every tiny block."""
        for segment, blocks in self._blocks.items():
            for offset, size, owner in blocks:
                yield segment, offset, size, owner

    def _put(self, segment: int, i: int, offset: int, nbytes: int, owner: int) -> None:
        self._blocks[segment].insert(i, (offset, nbytes, owner))
        self._where[owner] = segment, offset
