"""Counters the rematerialization runtime keeps about itself, apart from its decisions."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Telemetry:
    """What one runtime did. Times are wall-clock seconds of the host, not simulated time."""

    evictions: int = 0  # storages evicted to make room (not counting dead ones freed)
    recomputations: int = 0  # op re-runs that restored an evicted storage
    searches: int = 0  # calls to the policy's victim search
    search_seconds: float = 0.0
    evicting_allocations: int = 0  # allocations that had to evict before they fitted
    relaxations: int = 0  # times the callers' locks were dropped (NOTE [relaxed locks] in ``core.runtime``)
    free_fraction_sum: float = 0.0  # sum over those of free bytes / capacity once placed
    peak_bytes: int = 0  # most bytes held by the pool at once
    # Most bytes an op needed at its first run (constants, inputs, new outputs, scratch), or the end:
    # no budget below it can work, but it may not suffice (NOTE [worst case] in ``core.worst_case``).
    working_set: int = 0

    @property
    def fragmentation(self) -> float:
        """Mean free bytes / capacity over the allocations that had to evict (0 when none did)."""
        if self.evicting_allocations == 0:
            return 0.0
        return self.free_fraction_sum / self.evicting_allocations
