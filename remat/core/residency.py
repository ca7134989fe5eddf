"""Where each storage of a runtime stands: resident or not, locked by which op in progress,
evictable, which handles point at it, and what policies read of it.

:class:`Residency` is the state a :class:`~remat.core.runtime.Runtime` decides over, and all that an
eviction policy reads (:mod:`remat.core.policies.base`): the recomputation graph, the pool, the
per-storage columns, and the evicted classes and neighbourhoods kept for the policies that ask.
Its methods keep those consistent as storages arrive, depart, get locked and lose their handles;
the runtime's decisions (what to restore, evict, allocate) build on them.
"""

from __future__ import annotations

from remat.core.backend import Backend
from remat.core.classes import EvictedClasses
from remat.core.graph import Column, Graph
from remat.core.neighbourhood import Neighbourhoods
from remat.core.pool import Pool
from remat.core.telemetry import Telemetry


class Frame:
    """One op being run or restored: the storages it has locked. (A plain class with slots: the
    runtime makes one or two per op.)"""

    __slots__ = ("locked", "relaxed", "firm")

    def __init__(self, firm: bool = False) -> None:
        self.locked: list[int] = []
        self.relaxed = False
        self.firm = firm  # its locks are never relaxed (the storages the program ends holding)


class Residency:
    """The state of every storage of one program within ``pool``; ``classes`` and ``regions``:
    track evicted equivalence classes and exact neighbourhoods (for the policies that read them)."""

    def __init__(self, pool: Pool, backend: Backend, classes: bool, regions: bool) -> None:
        self.pool = pool
        self.backend = backend
        self.graph = Graph()
        self.classes = EvictedClasses() if classes else None
        self.regions = Neighbourhoods() if regions else None
        self.telemetry = Telemetry()
        self.clock = 0.0
        self.resident: list[bool] = []
        self.locks: list[int] = []
        self.live: list[int] = []  # live handles per storage
        self.last = Column()  # last access per storage, in op time
        self.evictable = Column(bool)  # resident, unlocked, not constant, not empty
        self.evicted_nearby = Column()  # cost of the non-resident neighbours: a bound for policies
        self._counted: list[bool] = []  # storage adds its cost to its neighbours' evicted_nearby
        self._members: list[list[int]] = []  # every handle ever pointed at a storage
        self._storage_of: dict[int, int] = {}

    def storage_of(self, handle: int) -> int:
        return self._storage_of[handle]

    # -- arrivals and departures ---------------------------------------------------------------

    def _dead(self, storage: int) -> None:
        """No handle is left. Constants stay (recomputations may read them), and so do empty
        storages (keeping them is free, losing them would cost a recomputation)."""
        graph = self.graph
        if (
            self.resident[storage]
            and not graph.constant[storage]
            and graph.nbytes[storage] > 0
            and self.locks[storage] == 0
        ):
            self.pool.free(storage)
            self._depart(storage)

    def _arrive(self, storage: int) -> None:
        self.resident[storage] = True
        self.last.set(storage, self.clock)
        if self._counted[storage]:
            self._count_nearby(storage, -1.0)
        if self.classes is not None:
            self.classes.restored(storage, self.graph)
        if self.regions is not None:
            self.regions.restored(storage)
        graph = self.graph  # ``_evictable``, inlined: every op's outputs arrive
        if self.locks[storage] == 0 and not graph.constant[storage] and graph.nbytes[storage] > 0:
            self.evictable.set(storage, True)

    def _depart(self, storage: int) -> None:
        self.resident[storage] = False
        self.evictable.set(storage, False)
        self._count_nearby(storage, 1.0)
        if self.classes is not None:
            self.classes.evicted(storage, self.graph, self.resident)
        if self.regions is not None:
            self.regions.evicted(storage)
        self.backend.free(storage)

    def _count_nearby(self, storage: int, sign: float) -> None:
        self._counted[storage] = sign > 0
        graph = self.graph
        cost, nearby = sign * graph.cost[storage], self.evicted_nearby
        parents, children = graph.parents[storage], graph.children[storage]
        if not parents and not children:
            return
        values = nearby.values
        for neighbour in set(parents + children):
            nearby.set(neighbour, values[neighbour] + cost)

    def _evictable(self, storage: int) -> bool:
        return self.resident[storage] and not self.graph.constant[storage] and self.graph.nbytes[storage] > 0

    # -- bookkeeping ----------------------------------------------------------------------------

    def _new_storage(self, nbytes: int, producer: int, constant: bool, parents: tuple[int, ...]) -> int:
        storage = self.graph.add_storage(nbytes, producer, constant, parents)
        if self.regions is not None:
            self.regions.created(storage, parents)
        self.resident.append(False)
        self.locks.append(0)
        self.live.append(0)
        self.last.values.append(self.clock)  # Column.append
        self.evictable.values.append(False)
        self.evicted_nearby.values.append(0.0)
        self._counted.append(False)
        self._members.append([])
        return storage

    def _bind(self, handle: int, storage: int) -> None:
        self._storage_of[handle] = storage
        self._members[storage].append(handle)
        self.live[storage] += 1

    def _move_handles(self, old: int, new: int) -> None:
        """A mutation made ``new`` the current version of ``old``: every handle follows."""
        for handle in self._members[old]:
            self._storage_of[handle] = new
        self._members[new].extend(self._members[old])
        self._members[old] = []
        self.live[new] += self.live[old]
        self.live[old] = 0
        self._dead(old)

    def _lock(self, frame: Frame, storage: int) -> None:
        self.locks[storage] += 1
        frame.locked.append(storage)
        self.evictable.set(storage, False)

    def _unlock_all(self, frame: Frame) -> None:
        locks, resident, constant, nbytes = self.locks, self.resident, self.graph.constant, self.graph.nbytes
        for storage in frame.locked:
            locks[storage] -= 1
            # ``_evictable``, inlined: every op unlocks its inputs
            if locks[storage] == 0 and resident[storage] and not constant[storage] and nbytes[storage] > 0:
                self.evictable.set(storage, True)
        frame.locked = []
