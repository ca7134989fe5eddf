"""Swapping: a victim whose copy to the host hides behind compute goes to host memory instead of
being dropped, and comes back over the link instead of being recomputed (Capuchin, ASPLOS'20).

Eviction trades compute for memory, offload trades link time for it. Capuchin's observation is that
the two mix per tensor: a tensor idle long enough for its copy to finish in the meantime costs no
time to send away, and if its reload is cheaper than recomputing it, swapping beats evicting. The
runtime asks :meth:`Swap.out` for every victim its policy chose; the policy itself is unchanged.

The time model, on one :class:`remat.Link` (NOTE [swap timing]):

- A copy to the host may start once the tensor was last used (the runtime knows it has been idle
  since, as Capuchin issues the copy after a tensor's last access) and once the link has finished
  the copies before it; its device bytes are free when it ends. A victim is swapped only when that
  end is not after now, so freeing its bytes never waits; and only when the part of its reload
  that its idle time so far would not hide takes no longer than re-running its producer (DTR's
  staleness as the guess of the time to the next use; recomputation would be cheaper otherwise).
- A reload may start once the copy reached the host and the link has finished the reloads before
  it, as if prefetched in the order the program needs them; the program stalls only for the part
  that runs past the moment it needs the tensor. The reload's early arrival on the device is not
  charged to the device memory: the figures are a bound on what prefetching can hide.
- The host copy stays while the storage lives (a storage is one immutable version, so evicting it
  again costs no copy) and is dropped when the program releases it.

The work itself goes through a :class:`HostStore` (the simulator keeps values; an eager runtime
keeps bytes in a host buffer the device allocator does not see).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from remat.core.residency import Residency

if TYPE_CHECKING:
    from remat.host.link import Link


class HostStore(Protocol):
    """Where swapped contents go: the backend's side of swapping."""

    def swap_out(self, storage: int) -> None:
        """Keep a host copy of resident ``storage`` (its device copy is freed next)."""
        ...

    def swap_in(self, storage: int) -> None:
        """Bring the host copy of ``storage`` back to the device; its device memory is given."""
        ...

    def drop(self, storage: int) -> None:
        """The host copy of ``storage`` is no longer needed."""
        ...


@dataclass
class SwapCounts:
    """What swapping did; times in the program's op seconds."""

    swaps: int = 0  # victims sent to the host instead of dropped (a storage may go more than once)
    reloads: int = 0  # host copies brought back instead of recomputed
    d2h_bytes: int = 0  # bytes copied to the host (a victim whose copy was kept costs none)
    h2d_bytes: int = 0
    host_bytes: int = 0  # bytes held on the host now
    host_peak: int = 0
    stall_seconds: float = 0.0  # time the program waited for reloads


class Swap:
    """Swapping victims to the host over ``link``, the contents kept by ``store``."""

    def __init__(self, link: Link, store: HostStore) -> None:
        self.link = link
        self.store = store
        self.counts = SwapCounts()
        self._on_host: dict[int, float] = {}  # storage -> when its host copy was complete
        self._d2h_free = 0.0  # when the link's copies to the host end
        self._h2d_free = 0.0

    def holds(self, storage: int) -> bool:
        """Whether ``storage`` has a host copy."""
        return storage in self._on_host

    def out(self, runtime: Residency, storage: int) -> bool:
        """``storage`` is about to be evicted: send it to the host when that is free of stalls and
        its reload beats its recomputation (NOTE [swap timing] in the module docstring). Returns
        whether it went."""
        counts = self.counts
        if storage in self._on_host:
            counts.swaps += 1
            return True
        nbytes, last = runtime.graph.nbytes[storage], runtime.last.values[storage]
        idle = runtime.clock - last  # DTR's staleness, here the guess of the time to its next use
        if self.link.h2d_seconds(nbytes) - idle > runtime.graph.cost[storage]:
            return False
        end = max(last, self._d2h_free) + self.link.d2h_seconds(nbytes)
        if end > runtime.clock:
            return False
        self._d2h_free = end
        self._on_host[storage] = end
        self.store.swap_out(storage)
        counts.swaps += 1
        counts.d2h_bytes += nbytes
        counts.host_bytes += nbytes
        counts.host_peak = max(counts.host_peak, counts.host_bytes)
        return True

    def back(self, runtime: Residency, storage: int) -> float:
        """Bring ``storage``'s host copy back (its device memory is given); returns the seconds the
        program stalls for it."""
        nbytes = runtime.graph.nbytes[storage]
        ready = max(self._on_host[storage], self._h2d_free) + self.link.h2d_seconds(nbytes)
        self._h2d_free = ready
        stall = max(0.0, ready - runtime.clock)
        self.store.swap_in(storage)
        self.counts.reloads += 1
        self.counts.h2d_bytes += nbytes
        self.counts.stall_seconds += stall
        return stall

    def forget(self, runtime: Residency, storage: int) -> None:
        """The program released ``storage``: its host copy, if any, goes."""
        if self._on_host.pop(storage, None) is not None:
            self.counts.host_bytes -= runtime.graph.nbytes[storage]
            self.store.drop(storage)
