"""Where each storage of a runtime stands: resident or not, locked by which op in progress,
evictable, which handles point at it, and what policies read of it.

:class:`Residency` is the state a :class:`~remat.core.runtime.Runtime` decides over, and all that an
eviction policy reads (:mod:`remat.core.policies.base`): the recomputation graph, the pool, the
per-storage columns, and the evicted classes and neighbourhoods kept for the policies that ask.
Its methods keep those consistent as storages arrive, depart, get locked and lose their handles;
the runtime's decisions (what to restore, evict, allocate) build on them.

NOTE [wanted at the end] A storage the program will still hold when it ends (a parameter's
gradient: the program says so through :meth:`Residency.want`) must be resident then anyway:
evicting it only moves its cost to the end, where restoring it re-runs the chain that made it (a
gradient made early in the backward needs most of the backward again). A wanted storage is
therefore hidden from the policies (not ``evictable``) and evicted only as a last resort, when
nothing else can make room (:meth:`Residency._expose_wanted`); where the pool's addresses are a
model (``compact``), its block moves down out of the way of later allocations
(:meth:`~remat.core.pool.AddressPool.lower`). The mark follows the program's
handles to a new version when the storage is mutated (a gradient accumulated in place) and ends
when the program drops its last handle. Each mark is recorded with the number of ops run before it
(``wants``), so that another run of the same program can make it at the same moment
(:meth:`Residency.expect`): the simulator then takes the decisions the runtime took.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat._errors import message
from remat.core.backend import Backend
from remat.core.classes import EvictedClasses
from remat.core.graph import Column, Graph, Record
from remat.core.neighbourhood import Neighbourhoods
from remat.core.pool import Pool
from remat.core.telemetry import Telemetry

# NOTE [unfilled results] An ``empty`` op's result holds no value an op gave it: C++ code may fill
# it through its data pointer between later ops (``_pad_packed_sequence`` writes the lengths it
# returns so, while it copies the sequences with ops). Evicted in between, its memory would be
# written after it was freed, and recomputed it would come back unfilled: it is never evicted
# while the program holds it (``pinned``, from its first run until it departs). An op that writes
# it makes a new version, evictable as any other; the old one, freed with its last handle and
# restored later only as an input of a recomputation (a dropout mask's ``bernoulli_``), is too.
# the ops whose result holds no value an op gave it (NOTE [unfilled results]), by overload
UNFILLED = frozenset(
    {
        "aten.empty.memory_format",
        "aten.empty.names",
        "aten.empty_like.default",
        "aten.empty_strided.default",
        "aten.empty_permuted.default",
        "aten.new_empty.default",
        "aten.new_empty_strided.default",
    }
)


# NOTE [restore cycles] Restoring a storage re-runs its producer and then re-derives its views,
# whose ops may read other storages; in a trace where a view op reads a tensor made from its own
# base (not an op PyTorch has: a hand-made or foreign trace), restoring the base needs the base:
# the recursion would not end. A restore entered again for a storage it is restoring is refused.
def restore_cycle(storage: int, record: Record) -> str:
    rule = "restoring a tensor needs that tensor itself (a view op reads a tensor made from its own base)"
    given = f"storage {storage}, made by op {record.op.index} ({record.op.name})"
    return message("core.Runtime", rule, given, "a view op may read only its base")


class Frame:
    """One op being run or restored: the storages it has locked. (A plain class with slots: the
    runtime makes one or two per op.)"""

    __slots__ = ("locked", "gathering", "relaxed", "firm")

    def __init__(self, firm: bool = False) -> None:
        self.locked: list[int] = []
        self.gathering: Sequence[int] = ()  # the storages it makes resident together
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
        self.evictable = Column(bool)  # resident, unlocked, not constant, not empty, not wanted, not pinned
        self.pinned: set[int] = set()  # NOTE [unfilled results]
        self._restoring: set[int] = set()  # NOTE [restore cycles]
        self.wanted: list[bool] = []  # NOTE [wanted at the end]
        self.compact = False  # the pool's addresses are a model (NOTE [model addresses] in ``runtime``)
        self.wants: list[tuple[int, int]] = []  # (ops run before the mark, handle), in order
        self._due: dict[int, list[int]] = {}  # ops run -> handles to mark then (:meth:`expect`)
        self.evicted_nearby = Column()  # cost of the non-resident neighbours: a bound for policies
        self._counted: list[bool] = []  # storage adds its cost to its neighbours' evicted_nearby
        self._members: list[list[int]] = []  # every handle ever pointed at a storage
        self._storage_of: dict[int, int] = {}
        self._frames: list[Frame] = []  # the ops being run or restored, the innermost last
        self._gatherers: list[int] = []  # per storage: the frames whose ``gathering`` holds it

    def storage_of(self, handle: int) -> int:
        return self._storage_of[handle]

    def want(self, handle: int) -> None:
        """The program will hold ``handle`` when it ends: keep its storage resident unless nothing
        else can make room (NOTE [wanted at the end])."""
        self.wants.append((len(self.graph.records), handle))
        storage = self._storage_of[handle]
        if self.live[storage] > 0:
            self._want(storage)

    def expect(self, wants: Sequence[tuple[int, int]]) -> None:
        """Make the marks another run recorded (its ``wants``) at the same moments: each just before
        the op that ran after it (:meth:`_due_marks`)."""
        for position, handle in wants:
            self._due.setdefault(position, []).append(handle)

    def _due_marks(self) -> None:
        """The marks :meth:`expect` scheduled before the op about to run."""
        for handle in self._due.pop(len(self.graph.records), ()):
            self.want(handle)

    # -- arrivals and departures ---------------------------------------------------------------

    def _dead(self, storage: int) -> None:
        """No handle is left. Constants stay (recomputations may read them), and so do empty
        storages (keeping them is free, losing them would cost a recomputation)."""
        self.wanted[storage] = False
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
        if (
            self.locks[storage] == 0
            and not graph.constant[storage]
            and graph.nbytes[storage] > 0
            and not self.wanted[storage]
            and storage not in self.pinned
        ):
            self.evictable.set(storage, True)

    def _depart(self, storage: int) -> None:
        self.resident[storage] = False
        self.evictable.set(storage, False)
        self.pinned.discard(storage)  # gone with its last handle: restored, no C++ holds it
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
        graph = self.graph
        return (
            self.resident[storage]
            and not graph.constant[storage]
            and graph.nbytes[storage] > 0
            and not self.wanted[storage]
            and storage not in self.pinned
        )

    def _want(self, storage: int) -> None:
        self.wanted[storage] = True
        self.evictable.set(storage, False)
        graph = self.graph
        movable = self.resident[storage] and graph.nbytes[storage] > 0 and not graph.constant[storage]
        if self.compact and movable:
            self.pool.lower(storage)  # out of the evictable memory's way: it stays

    def _expose_wanted(self) -> list[int]:
        """The last resort (NOTE [wanted at the end]): let the policy choose among the wanted
        storages that are resident and unlocked, until :meth:`_hide` hides them again. Returns them."""
        exposed = [
            s
            for s, wanted in enumerate(self.wanted)
            if wanted
            and self.resident[s]
            and self.locks[s] == 0
            and self.graph.nbytes[s] > 0
            and not self.graph.constant[s]  # a constant is never evicted, wanted or not
            and s not in self.pinned
        ]
        for storage in exposed:
            self.evictable.set(storage, True)
        return exposed

    def _hide(self, exposed: list[int]) -> None:
        """Hide again what :meth:`_expose_wanted` exposed and the policy left resident."""
        for storage in exposed:
            if self.evictable.values[storage]:
                self.evictable.set(storage, False)

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
        self.wanted.append(False)
        self._counted.append(False)
        self._members.append([])
        self._gatherers.append(0)
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
        if self.wanted[old]:
            self._want(new)
        self._dead(old)

    def _awaited(self, storage: int) -> bool:
        """Whether ``storage`` is not resident and worth keeping once made: the program holds it, or
        an op being run or restored is gathering it."""
        if self.resident[storage]:
            return False
        return self.live[storage] > 0 or self._gatherers[storage] > 0

    def _gathers(self, frame: Frame, storages: Sequence[int]) -> None:
        """``frame`` makes ``storages`` resident together, until :meth:`_leave`."""
        gatherers = self._gatherers
        for storage in frame.gathering:
            gatherers[storage] -= 1
        for storage in storages:
            gatherers[storage] += 1
        frame.gathering = storages

    def _leave(self, frame: Frame) -> None:
        """``frame``, the innermost, is done: its locks go, and it gathers nothing any more."""
        self._unlock_all(frame)
        self._gathers(frame, ())
        self._frames.pop()

    def _derivable(self, storage: int, record: Record) -> bool:
        """Whether every view of ``storage``, an output ``record`` has just made, can be derived
        again: its inputs are resident or made by ``record``."""
        graph, resident, made = self.graph, self.resident, record.outputs
        return all(resident[p] or p in made for v in graph.views[storage] for p in graph.records[v].inputs)

    def _relax(self) -> bool:
        """NOTE [relaxed locks] in ``runtime``: drop the locks of the callers of the running op."""
        dropped = False
        for frame in self._frames[:-1]:
            if frame.locked and not frame.firm:
                self._unlock_all(frame)
                frame.relaxed = dropped = True
        self.telemetry.relaxations += dropped
        return dropped

    def _lock(self, frame: Frame, storage: int) -> None:
        self.locks[storage] += 1
        frame.locked.append(storage)
        self.evictable.set(storage, False)

    def _unlock_all(self, frame: Frame) -> None:
        locks, resident, constant, nbytes = self.locks, self.resident, self.graph.constant, self.graph.nbytes
        wanted = self.wanted
        for storage in frame.locked:
            locks[storage] -= 1
            # ``_evictable``, inlined: every op unlocks its inputs
            if (
                locks[storage] == 0
                and resident[storage]
                and not constant[storage]
                and nbytes[storage] > 0
                and not wanted[storage]
                and storage not in self.pinned
            ):
                self.evictable.set(storage, True)
        frame.locked = []
