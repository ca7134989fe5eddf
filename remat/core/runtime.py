"""The rematerialization runtime: keep tensors within a memory pool by evicting and recomputing.

Device-free on purpose. The runtime decides what is resident, what to evict and what to recompute;
the work itself goes through a :class:`~remat.core.backend.Backend`: the simulator's backend only
adds up recorded op times and checks values, an eager runtime runs real ops and frees real tensors.
Both thereby share every decision this module makes.

The program speaks in *handles* (trace tensor ids): :meth:`Runtime.constant`, :meth:`Runtime.call`,
:meth:`Runtime.release`, and :meth:`Runtime.finish` at the end. Handles point at storages of the
:class:`~remat.core.graph.Graph`. The rules:

- The inputs of the running op are locked (pinned); constants are never evicted (kept even with no
  handle left: recomputations may read them); what the program wants at its end is evicted last
  (NOTE [wanted at the end] in :mod:`remat.core.residency`).
- An evicted storage is restored by re-running its producer, whose inputs are gathered first,
  recursively (``_gather`` -> ``_restore`` -> ``_gather`` ...).
- A storage whose handles are all released is freed at once but stays in the graph as evicted
  metadata, for the recomputations that may need it.
- A mutation moves every handle of the mutated storage to a new version. With ``inplace`` (Coop) the
  version takes over the old memory; otherwise (DTR) it is copied into new memory.

NOTE [model addresses]: where the pool's addresses model a layout that the memory does not have
(``compact``: tensors in PyTorch's allocator, whose free memory is not split as the model's is),
an allocation that finds enough free bytes but no piece large enough, with nothing left to evict,
packs the pool instead of failing, as does the end of the program before it restores what the
program holds. The simulator does neither: its figures are for memory laid out as the pool says.

NOTE [relaxed locks]: a restore deep in a recomputation runs while the callers' gathered inputs are
locked, so it can need more memory than any op of the program. When nothing is left to evict, the
callers' locks are dropped and each caller gathers again once the restore returns: the runtime
only fails when a single op's own inputs and outputs, plus the constants, do not fit, or at the end
beside what is held firm. A caller may lose what it had gathered meanwhile, and two inputs whose
restores do not fit beside each other can evict each other for ever (the thrash limit stops it);
counting bytes at the worst case, with no storage marked wanted, no lock is ever dropped (NOTE
[worst case] in :mod:`remat.core.worst_case`). A pool whose addresses are a model is packed before
any lock is dropped: packing costs nothing, a dropped lock a recomputation.

NOTE [by-products kept]: a restore re-runs its producer whole; an output already resident gets a
throwaway copy. One not resident (evicted meanwhile, once the callers' locks are relaxed) that the
program holds or an op is gathering is kept, else two outputs of one op, each the other's copy,
evict each other for ever; unless a view of it reads what the run neither made nor holds. Copies
and outputs not kept are freed only once the views are derived again: a view may read any."""

from __future__ import annotations

import time
from collections.abc import Sequence

from remat._errors import RematValueError, message
from remat.core import owners
from remat.core.backend import Backend
from remat.core.graph import NO_REUSE, Record
from remat.core.policies.base import EvictionPolicy
from remat.core.pool import End, OutOfMemory, Pool
from remat.core.residency import UNFILLED, Frame, Residency, restore_cycle
from remat.core.swap import Swap
from remat.trace.types import Op, TensorInfo


class Runtime(Residency):
    """Dynamic rematerialization of one program within ``pool``, choosing victims by ``policy``;
    with ``swap``, a victim may go to the host instead (:mod:`remat.core.swap`)."""

    def __init__(
        self,
        pool: Pool,
        policy: EvictionPolicy,
        backend: Backend,
        compact: bool = False,
        swap: Swap | None = None,
    ) -> None:
        missing = set(policy.needs) - ({"layout"} if pool.layout else set()) - {"classes", "regions"}
        if missing:
            given = f"policy {policy.name!r} needs {sorted(missing)}, pool is a {type(pool).__name__}"
            rule = "the policy needs state this pool does not track"
            raise RematValueError(message("core.Runtime", rule, given, "use an AddressPool"))
        super().__init__(pool, backend, "classes" in policy.needs, "regions" in policy.needs)
        self.policy = policy
        # The pool's addresses are a model, not the memory (an eager runtime whose tensors live in
        # PyTorch's allocator): when only their pieces stand in the way, pack them (NOTE [model
        # addresses]).
        self.compact, self.swap = compact, swap
        self._constant_bytes = 0  # constants never leave the pool

    # -- the program's side ---------------------------------------------------------------------

    def constant(self, handle: int, nbytes: int) -> None:
        """A tensor from outside (parameter, input): resident from now on, never evicted."""
        storage = self._new_storage(nbytes, -1, True, ())
        if nbytes > 0:
            self._frames.append(frame := Frame())
            try:
                self._allocate(storage, nbytes, End.LOW)
            finally:
                self._leave(frame)
        self._arrive(storage)
        self._bind(handle, storage)
        self._constant_bytes += nbytes

    def call(self, op: Op, outputs: Sequence[TensorInfo], prepared: bool = False) -> None:
        """Run ``op`` for the first time; ``outputs`` describe ``op.outputs`` in order. ``prepared``:
        :meth:`prepare` made the inputs resident just before, and their accesses are counted."""
        if self._due:
            self._due_marks()
        storage_of, graph = self._storage_of, self.graph
        inputs = tuple(dict.fromkeys(map(storage_of.__getitem__, op.inputs)))
        sizes, constants = graph.nbytes, graph.constant
        held = op.scratch + op.state + sum(info.nbytes for info in outputs if info.alias_of is None)
        held += sum(sizes[s] for s in inputs if not constants[s])
        if held + self._constant_bytes > self.pool.capacity:  # what no policy can run: say so now
            raise OutOfMemory(held, self._constant_bytes, self.pool.capacity, False, whole=True)
        self._frames.append(frame := Frame())
        try:
            self._gather(frame, inputs, touch=not prepared)
            if op.state > 0:  # kept from now on, like a constant of no handle
                state = self._new_storage(op.state, -1, True, ())
                self._allocate(state, op.state, End.LOW)
                self._arrive(state)
                self._constant_bytes += op.state
            record = graph.add_record(op, inputs)
            new, rid = self._new_storage, record.id
            created = [new(info.nbytes, rid, False, inputs) for info in outputs if info.alias_of is None]
            if op.name in UNFILLED:  # NOTE [unfilled results] in ``residency``
                self.pinned.update(created)
            reuse = [NO_REUSE] * len(created)
            mutated = list(dict.fromkeys(storage_of[h] for h in op.mutates))  # a tensor and its view: one
            for old in mutated:  # each storage written gets a new version
                created.append(new(graph.nbytes[old], rid, graph.constant[old], inputs))
                reuse.append(old)
            record.outputs, record.reuse = tuple(created), tuple(reuse)
            if not created:  # only views of inputs: restoring their storage re-runs this op
                for info in outputs:
                    if info.alias_of is not None:
                        self.graph.add_view(self._storage_of[info.alias_of], record)
                        if len(inputs) > 1 and self.regions is not None:  # new edges
                            self.regions.clear()
                        break
            allocated = self._run(frame, record, recompute=False, keep=record.outputs)
            need = self._constant_bytes + allocated + op.scratch
            for s in inputs:
                if not constants[s]:
                    need += sizes[s]
            if need > self.telemetry.working_set:
                self.telemetry.working_set = need
        finally:
            self._leave(frame)
        made = iter(record.outputs)
        members, live = self._members, self.live
        for handle, info in zip(op.outputs, outputs, strict=True):  # ``_bind``, inlined
            storage = storage_of[info.alias_of] if info.alias_of is not None else next(made)
            storage_of[handle] = storage
            members[storage].append(handle)
            live[storage] += 1
        for old, version in zip(mutated, made, strict=True):
            if graph.constant[version] and self.resident[old]:  # a copied constant: both stay
                self._constant_bytes += graph.nbytes[version]
            self._move_handles(old, version)
            if self.swap is not None:
                self.swap.forget(self, old)

    def prepare(self, handles: Sequence[int]) -> None:
        """Make the storages of ``handles`` resident as :meth:`call` does before it runs an op reading
        them, and leave them unlocked: an eager runtime runs an op to size its outputs, so it restores
        the inputs first; the :meth:`call` that follows finds them resident and decides the rest."""
        storage_of, resident = self._storage_of, self.resident
        inputs = tuple(dict.fromkeys(map(storage_of.__getitem__, handles)))
        if not self._frames:  # all resident: gathering them would only touch them (locks undone)
            for storage in inputs:
                if not resident[storage]:
                    break
            else:
                last, clock = self.last, self.clock
                for storage in inputs:
                    last.set(storage, clock)
                return
        frame = Frame()
        self._frames.append(frame)
        try:
            self._gather(frame, inputs)
        finally:
            self._leave(frame)

    def overwrites(self, handle: int) -> bool:
        """For a storage that is not a constant: whether the next :meth:`call` from the program, right
        after :meth:`prepare` and mutating ``handle``, lets the new version take over the old memory
        (:meth:`_may_overwrite` for a frame with the only lock): an eager runtime that runs the op
        before :meth:`call` must know whether to keep a copy of the old content."""
        old = self._storage_of[handle]
        return self.policy.inplace and self.resident[old] and self.locks[old] == 0

    def release(self, handle: int) -> None:
        """The program dropped ``handle``; a storage with no handle left is freed (not forgotten)."""
        storage = self._storage_of[handle]
        self.live[storage] -= 1
        if self.live[storage] == 0:
            self._dead(storage)
            if self.swap is not None:
                self.swap.forget(self, storage)

    def finish(self) -> None:
        """The program ends holding its live handles: restore every storage they point at, all
        resident at once within the pool (held together from now on), or raise OutOfMemory."""
        self._due_marks()  # those :meth:`expect` has after the last op
        live = [s for s, n in enumerate(self.live) if n > 0]
        needed = sum(self.graph.nbytes[s] for s in live if not self.graph.constant[s])
        self.telemetry.working_set = max(self.telemetry.working_set, needed + self._constant_bytes)
        if needed + self._constant_bytes > self.pool.capacity:
            raise OutOfMemory(needed, self._constant_bytes, self.pool.capacity, False, whole=True)
        if self.compact:
            self.pool.compact()
        # In the order they were made, each restored (the earlier ones' chains are the later ones'
        # ancestors) and then held firm, so that no restore undoes an earlier one.
        self._frames.append(frame := Frame(firm=True))
        try:
            for storage in live:
                if not self.resident[storage]:
                    self._restore(storage)
                self._lock(frame, storage)
        finally:
            self._leave(frame)

    # -- restoring ------------------------------------------------------------------------------

    def _gather(self, frame: Frame, storages: Sequence[int], touch: bool = True) -> None:
        """Make every storage of ``storages`` resident at once, locked by ``frame``; ``touch``: the
        ones already resident count as used now."""
        resident, locks, evictable = self.resident, self.locks, self.evictable
        if touch:
            last, clock = self.last, self.clock
            for storage in storages:
                if resident[storage]:
                    last.set(storage, clock)
        self._gathers(frame, storages)
        while True:
            frame.relaxed = False
            locked, flags, missing = frame.locked, evictable.values, []
            for storage in storages:  # lock the resident ones (``_lock``, inlined), find the others
                if not resident[storage]:
                    missing.append(storage)
                elif storage not in locked:
                    locks[storage] += 1
                    locked.append(storage)
                    if flags[storage]:  # a constant or a locked storage is not evictable already
                        evictable.set(storage, False)
            if not missing:
                return
            for storage in missing:
                if not resident[storage]:
                    self._restore(storage)
                if frame.relaxed:  # NOTE [relaxed locks]: gather again
                    break
                self._lock(frame, storage)

    def _restore(self, storage: int) -> None:
        """Bring back evicted ``storage`` by re-running its producer (and its views)."""
        graph = self.graph
        record = graph.records[graph.producer[storage]]
        if self.swap is not None and self.swap.holds(storage):
            self._reload(storage, record, self.swap)
            return
        if storage in self._restoring:  # NOTE [restore cycles] in ``residency``
            raise RematValueError(restore_cycle(storage, record))
        frame = Frame()
        self._frames.append(frame)
        self._restoring.add(storage)
        try:
            needed = list(record.inputs)
            needed += [p for p in graph.parents[storage] if p not in needed]
            self._gather(frame, needed)
            if self.resident[storage]:  # kept by a restore the gather ran (NOTE [by-products kept])
                return
            keep = tuple(s for s in record.outputs if s == storage or self._awaited(s))
            self._run(frame, record, recompute=True, keep=keep)
            self.telemetry.recomputations += 1
        finally:
            self._restoring.discard(storage)
            self._leave(frame)

    def _reload(self, storage: int, record: Record, swap: Swap) -> None:
        """Bring back swapped ``storage`` from the host, then re-derive its views as a restore does."""
        graph = self.graph
        frame = Frame()
        self._frames.append(frame)
        try:
            views = [graph.records[v] for v in graph.views[storage]]
            self._gather(frame, [s for view in views for s in view.inputs if s != storage])
            self._allocate(storage, graph.nbytes[storage], self.policy.end(record.op))
            self.clock += swap.back(self, storage)
            self._arrive(storage)
            for view in views:
                self.clock += self.backend.materialize(view, True)
        finally:
            self._leave(frame)

    def _run(self, frame: Frame, record: Record, recompute: bool, keep: tuple[int, ...]) -> int:
        """Give ``record``'s outputs memory, run it, make ``keep`` resident; returns the bytes allocated."""
        graph = self.graph
        allocated = 0
        end = self.policy.end(record.op)
        takeovers: list[tuple[int, int]] = []
        transient: list[int] = []
        for storage, old in zip(record.outputs, record.reuse, strict=True):
            nbytes = graph.nbytes[storage]
            if nbytes == 0:
                continue
            if storage in keep and old != NO_REUSE and self._may_overwrite(old, frame, record):
                takeovers.append((storage, old))
            elif storage in keep:
                self._allocate(storage, nbytes, end)
                allocated += nbytes
            else:  # a by-product: an output already resident or no longer wanted
                self._allocate(owners.transient(storage), nbytes, end)
                transient.append(storage)
                allocated += nbytes
        scratch = record.op.scratch
        if scratch > 0:  # the kernel's own buffers, beside its inputs and outputs while it runs
            self._allocate(owners.scratch(record.id), scratch, end)
        try:
            self.clock += self.backend.materialize(record, recompute)
        finally:
            if scratch > 0:
                self.pool.free(owners.scratch(record.id))
        for storage, old in takeovers:
            self.pool.transfer(old, storage)
            self._depart(old)
        kept = [s for s in keep if not recompute or self._derivable(s, record)]  # NOTE [by-products kept]
        dropped = [s for s in keep if s not in kept]
        for storage in transient:
            if self._awaited(storage) and self._derivable(storage, record):
                self.pool.transfer(owners.transient(storage), storage)
                kept.append(storage)
        for storage in kept:
            self._arrive(storage)
        if recompute:
            for storage in kept:
                for view in graph.views[storage]:
                    self.clock += self.backend.materialize(graph.records[view], True)
        for storage in dropped:
            if graph.nbytes[storage] > 0:
                self.pool.free(storage)
            self.backend.free(storage)
        for storage in (s for s in transient if s not in kept):
            self.pool.free(owners.transient(storage))
            if not self.resident[storage]:
                self.backend.free(storage)
        return allocated

    def _may_overwrite(self, old: int, frame: Frame, record: Record) -> bool:
        """An in-place op may reuse ``old``'s memory when the policy says so, no one else holds a
        lock on it, and it is not a constant. NOTE [constants stay] A constant cannot be recomputed,
        and its content as it was before the program ran is what a failed step writes back
        (``remat.dynamic``): a write to a constant always gets new memory, and every version stays."""
        if not self.policy.inplace or not self.resident[old] or self.locks[old] != frame.locked.count(old):
            return False
        return not self.graph.constant[old]

    # -- memory ---------------------------------------------------------------------------------

    def _allocate(self, owner: int, nbytes: int, end: End) -> None:
        pool, telemetry = self.pool, self.telemetry
        evicted = compacted = False
        exposed: list[int] = []
        try:
            while not pool.allocate(owner, nbytes, end):
                start = time.perf_counter()
                victims = self.policy.choose(self, nbytes)
                telemetry.search_seconds += time.perf_counter() - start
                telemetry.searches += 1
                if not victims:
                    movable = self.evictable.array[: len(self.graph)]
                    pinned = pool.used - int(self.graph.nbytes_array[: len(self.graph)][movable].sum())
                    if self.compact and pool.layout and not compacted and pool.capacity - pinned >= nbytes:
                        pool.compact()  # NOTE [model addresses]: free and evictable bytes would do
                        compacted = True
                        continue
                    if self._relax():
                        compacted = False  # the locks dropped made more evictable
                        continue
                    if not exposed and (exposed := self._expose_wanted()):  # NOTE [wanted at the end]
                        continue
                    raise OutOfMemory(nbytes, pinned, pool.capacity, pool.layout)
                for victim in victims:
                    self._evict(victim)
                evicted = True
        finally:  # a wanted storage left resident is hidden again, even when nothing would fit
            self._hide(exposed)
        if evicted:
            telemetry.evicting_allocations += 1
            telemetry.free_fraction_sum += (pool.capacity - pool.used) / pool.capacity
        telemetry.peak_bytes = max(telemetry.peak_bytes, pool.used)

    def _evict(self, storage: int) -> None:
        if not self.evictable.values[storage]:
            raise ValueError(f"policy {self.policy.name!r} chose storage {storage}, which is not evictable")
        self.telemetry.evictions += 1
        if self.swap is not None:
            self.swap.out(self, storage)
        self.pool.free(storage)
        self._depart(storage)
