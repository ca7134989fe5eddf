"""What a ``remat.memory.track`` block measured: the data, apart from the measuring.

``remat.memory`` measures and ``remat.viz`` draws; both read these types, so neither imports the
other for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from remat._allocator import AllocatorSample
from remat._units import format_bytes


@dataclass(frozen=True)
class MemorySample:
    """Live bytes right after op number ``step`` (named ``op``) ran."""

    step: int
    op: str
    bytes: int


@dataclass
class MemoryTracker:
    """Figures of one ``track`` block, updated while the block runs.

    ``start_ns`` and ``end_ns``: ``time.time_ns()`` as the block started and ended, the clock of the
    allocator's samples and of ``remat.dynamic``'s moments (NOTE [profiler clock] in
    ``remat._allocator``). ``allocator_timeline``: with ``allocator=True`` on CPU, the bytes held
    after each allocation and free of the block, set when it ends; None where the allocator's events
    were not recorded (``allocator=False``, or CUDA, which has no event stream here).
    """

    device: torch.device
    current_bytes: int = 0
    peak_bytes: int = 0
    timeline: list[MemorySample] = field(default_factory=list)
    ops: int = 0  # ATen ops the block ran, counted only where a dispatch mode runs (see ``track``)
    start_ns: int = 0
    end_ns: int = 0
    allocator_timeline: tuple[AllocatorSample, ...] | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return (
            f"MemoryTracker({self.device}: peak {format_bytes(self.peak_bytes)}, "
            f"current {format_bytes(self.current_bytes)}, {self.ops} ops)"
        )
