"""The work behind the core's decisions: what a backend of :class:`~remat.core.runtime.Runtime` does.

The simulator's backend (:mod:`remat.sim.backend`) only adds up recorded op times and checks
values; the eager runtime's (:mod:`remat.dynamic.accounting`) runs real ops and frees real tensors.
"""

from __future__ import annotations

from typing import Protocol

from remat.core.graph import Record


class Backend(Protocol):
    """The work behind the runtime's decisions."""

    def materialize(self, record: Record, recompute: bool) -> float:
        """Run ``record`` (its inputs are resident, its outputs have memory) and return the seconds
        it took."""
        ...

    def free(self, storage: int) -> None:
        """The content of ``storage`` is gone (evicted, dead, or overwritten in place)."""
        ...
