"""A policy for the core's tests that never finds a victim: in a pool that never fills it is never
asked, and in one that does an allocation that does not fit runs out of memory at once."""

from __future__ import annotations

from dataclasses import dataclass

from remat.core.pool import End
from remat.core.residency import Residency
from remat.trace.types import Op


@dataclass(frozen=True)
class NeverEvicts:
    inplace: bool = False  # whether mutations reuse their input's memory
    name: str = "never-evicts"
    needs: frozenset[str] = frozenset()

    def end(self, op: Op) -> End:
        return End.LOW

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        return []
