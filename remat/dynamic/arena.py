"""The ``arena`` memory backend: one buffer of the budget's size, allocated up front, and every op
output placed at the address the pool chooses, so that layout and fragmentation are real (Coop).

An op's outputs are placed before it runs: the op is first run on meta tensors to learn their
sizes, the core picks addresses (evicting as it must), and the op's ``out=`` overload writes into
the arena there. A program storage points into the arena without owning it (a non-owning storage
made from an address, swapped under the program's storage as in :mod:`remat.dynamic.homes`), so
moving a tensor to another address on restore is a pointer swap as well.

Where an op has no ``out=`` overload taking the same arguments, or no reliable meta kernel, it runs
first and its results are copied into the arena: its outputs then briefly live outside the arena,
and the op is reported in ``copied``. Constants (parameters, inputs) stay where they are; their
pieces of the pool are holes in the arena, so the budget still counts them. At the end of the region
the tensors the program keeps are copied out of the arena, which is then freed; rebuilding the
evicted ones among them may use memory past the arena (NOTE [hand-over] in ``engine``).

NOTE [beside the arena] The arena is allocated whole from the region's start: evicting frees no
memory of the allocator's, so whatever an op holds outside the arena is over the pool's count, all
of it: its kernel's scratch, the results of an op run before they are placed (no ``out=`` kernel,
no meta kernel) until they are copied in, the old content of what such an op overwrites, the copies
of the hand-over. The budget leaves beside the pool the reserve and the room set aside for arriving
constants (``room``), less the constants that arrived in the block so far (their memory is their
own, their piece of the pool a hole in the arena). Before each such op the backend holds what it
will hold there against that room, and raises a RematValueError saying how much more reserve it
needs rather than pass the budget; an op whose results could not be sized ahead is checked once it
has run (their size is learned then for its next call). An ``out=`` form with no kernel of its own
for the device (convolution's backward: only a composite one) makes its results beside the arena
and copies them in, so placing through it holds its results there too (``_wraps``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from remat._errors import RematValueError, message
from remat._units import format_bytes
from remat.aten import scratch as op_scratch
from remat.core import owners
from remat.core.graph import NO_REUSE, Record
from remat.core.pool import AddressPool, Pool
from remat.dynamic.accounting import AccountingBackend, Pending
from remat.dynamic.backends import register
from remat.dynamic.homes import aligned, at, swap
from remat.dynamic.recipe import Recipe, result_leaves
from remat.dynamic.sizing import meta_results

OutOverload = tuple[Any, tuple[str, ...]]


def out_overload(func: Any) -> OutOverload | None:
    """The ``out=`` overload of ``func`` taking the same arguments, and its out argument names."""
    schema = func._schema
    if not schema.returns:
        return None
    if any(r.alias_info is not None for r in schema.returns):
        return None
    wanted = [(a.name, str(a.type)) for a in schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        overload = getattr(packet, name)
        arguments = overload._schema.arguments
        outs = [a for a in arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        rest = [(a.name, str(a.type)) for a in arguments if not any(a is o for o in outs)]
        if outs and len(outs) == len(schema.returns) and rest == wanted:
            return overload, tuple(a.name for a in outs)
    return None


@register
class ArenaBackend(AccountingBackend):
    """Places outputs in one preallocated buffer at the pool's addresses."""

    name = "arena"
    places = True
    bounds = False  # an out= result placed at a bound would be resized in the arena
    # an op with a result it does not return (a gradient its ``output_mask`` leaves out) runs
    # first: its ``out=`` overload takes every result
    unreturned = False

    @classmethod
    def create(cls, device: torch.device, thrash_limit: float, pool: Pool, reserve: int) -> ArenaBackend:
        """The backend of one region: its arena is what ``pool`` leaves of the budget, ``reserve``
        bytes of it beside the pool (NOTE [beside the arena])."""
        assert isinstance(pool, AddressPool)
        return cls(device, thrash_limit, pool, reserve)

    def __init__(self, device: torch.device, thrash_limit: float, pool: AddressPool, reserve: int) -> None:
        super().__init__(device, thrash_limit)
        self.pool = pool
        self.room = reserve
        self.entered = 0  # constants registered before the arena was allocated
        self.arrived = (0, 0)  # constants registered so far, and the bytes of those past ``entered``
        self.start = 0  # the pool's address of the arena's first byte (NOTE [arena offset])
        self.size = 0
        self.arena = torch.empty(0, dtype=torch.uint8, device=device)
        self.base = 0
        self.copied: set[str] = set()
        self.homes_of: dict[int, torch.UntypedStorage] = {}  # constant handle -> its own memory
        self._outs: dict[Any, OutOverload | None] = {}
        self._wrappers: dict[Any, bool] = {}

    def open(self) -> None:
        """The constants registered so far lie at the pool's low end: the arena covers the rest.

        NOTE [arena offset] The constants registered at the region's entry (``keep``) are placed
        first, from address 0 up, and never leave; they keep their own memory, so the arena starts
        past them and the budget does not count them twice. A constant first read later keeps its
        memory too and leaves a hole of its size in the arena: the room set aside for arriving
        constants covers it (NOTE [arriving constants] in ``keep``), and in a region's first block
        the reserve. The segments of the constants' tiny blocks lie among them and
        are sealed, so that no block of the arena's is placed there."""
        self.pool.seal()
        self.entered = len(self.homes.pinned)
        self.start = self.pool.used
        self.size = self.pool.capacity - self.start
        self.arena = torch.empty(self.size, dtype=torch.uint8, device=self.device)
        self.base = self.arena.data_ptr() - self.start

    # -- addresses ------------------------------------------------------------------------------

    def block(self, storage: int, nbytes: int) -> torch.UntypedStorage:
        """A non-owning storage of ``nbytes`` at the arena block holding ``storage`` (or its
        by-product)."""
        owner = storage if self.pool.holds(storage) else owners.transient(storage)
        return at(self.base + self.pool.address(owner), self.device, nbytes)

    def _inside(self, real: torch.UntypedStorage) -> bool:
        """Whether ``real`` has bytes in the arena (a ghost, NOTE [ghosts], has none)."""
        if real.nbytes() == 0:
            return False
        try:
            pointer = real.data_ptr()
        except RuntimeError:
            return False
        return self.base + self.start <= pointer < self.base + self.start + self.size

    def _move_into(self, storage: int, real: torch.UntypedStorage) -> torch.UntypedStorage:
        """Copy ``real``'s bytes into ``storage``'s block and point ``real`` there; returns the
        storage now holding ``real``'s former memory."""
        target = self.block(storage, real.nbytes())
        target.copy_(real)
        swap(real, target)
        return target

    def _out(self, func: Any) -> OutOverload | None:
        if func not in self._outs:
            self._outs[func] = out_overload(func)
        return self._outs[func]

    # -- beside the arena (NOTE [beside the arena]) ----------------------------------------------

    def left(self) -> int:
        """The bytes the budget leaves beside the arena now: the room less the constants arrived."""
        pinned = self.homes.pinned
        if len(pinned) != self.arrived[0]:
            late = list(pinned.values())[self.entered :]
            self.arrived = (len(pinned), sum(aligned(real.nbytes()) for real in late))
        return self.room - self.arrived[1]

    def beside(self, nbytes: int, what: str) -> None:
        """``what`` is about to hold ``nbytes`` outside the arena: raise when they do not fit."""
        left = self.left()
        if nbytes > left:
            given = f"{what} needs {format_bytes(nbytes)} beside the arena"
            if left < 0:  # tensors from before the region, first read mid-step, took it all
                given += (
                    f", where tensors first read mid-step already hold {format_bytes(self.arrived[1])}, "
                    f"{format_bytes(-left)} more than the reserve"
                )
            else:
                given += f", the reserve leaves {format_bytes(left)}"
            raise RematValueError(
                message(
                    "dynamic",
                    "the arena backend holds kernels' scratch, results copied in and the hand-over's "
                    "copies beside the arena, within the reserve",
                    given,
                    f"raise the reserve by {nbytes - left} bytes or more, name the tensors read "
                    "mid-step in keep, or use backend='accounting'",
                )
            )

    def ahead(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        fresh_returns: tuple[bool, ...],
        key: tuple[Any, ...],
        saved: dict[int, torch.UntypedStorage],
    ) -> None:
        """Hold an op run before it is placed against the room beside the arena: its results (as
        learned from an earlier run, else as its meta kernel tells), its scratch and ``saved``."""
        sizes = op_scratch.results(key)
        if sizes is None and any(fresh_returns):
            metas = meta_results(func, args, kwargs, fresh_returns)
            sizes = tuple(m.untyped_storage().nbytes() for m in metas or () if m is not None)
        copies = sum(real.nbytes() for real in saved.values())
        nbytes = sum(aligned(n) for n in sizes or ()) + aligned(op_scratch.known(key) or 0) + copies
        self.beside(nbytes, str(func))

    # -- first runs -----------------------------------------------------------------------------

    def placeable(self, func: Any, sized: bool = False) -> bool:
        return super().placeable(func, sized) and self._out(func) is not None

    def _wraps(self, overload: Any) -> bool:
        """Whether ``overload`` (an ``out=`` form) has no kernel of its own for the device, only a
        composite one that runs the plain form beside the arena and copies its results in."""
        found = self._wrappers.get(overload)
        if found is None:
            key = "CUDA" if self.device.type == "cuda" else "CPU"
            found = not torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key)
            self._wrappers[overload] = found
        return found

    def first_run(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        record: Record,
        pending: Pending,
        bind: Callable[[int, torch.Tensor], bool],
    ) -> tuple[Any, float]:
        n = len(pending.fresh)
        graph, homes = self.runtime.graph, self.homes
        # Copy on write where the core gave the new version a block of its own; else in place.
        for new, old, handle in zip(record.outputs[n:], record.reuse[n:], pending.written, strict=True):
            if graph.nbytes[new] > 0 and self.pool.holds(new):
                pending.saved[handle] = self._move_into(new, homes.get(old))
                if handle in homes.pinned and handle not in self.homes_of:
                    self.homes_of[handle] = pending.saved[handle]  # a constant's own memory
        outs: dict[str, torch.Tensor] = {}
        if not n:
            self.beside(record.op.scratch, record.op.name)
        else:
            overload, names = self._out(func)  # type: ignore[misc]
            results = sum(graph.nbytes[s] for s in record.outputs[:n]) if self._wraps(overload) else 0
            self.beside(record.op.scratch + results, record.op.name)
            for name, storage, handle, meta in zip(
                names, record.outputs[:n], pending.fresh, pending.metas, strict=True
            ):
                outs[name] = self._tensor_at(storage, meta)
                bind(handle, outs[name])
            func = overload
        return op_scratch.timed(lambda: func(*args, **kwargs, **outs), pending.learn)

    def _tensor_at(self, storage: int, meta: torch.Tensor) -> torch.Tensor:
        nbytes = meta.untyped_storage().nbytes()
        real = self.block(storage, nbytes) if nbytes else torch.UntypedStorage(0)
        return torch.empty(0, dtype=meta.dtype, device=self.device).set_(
            real, meta.storage_offset(), meta.shape, meta.stride()
        )

    def placed(self, record: Record, n_fresh: int) -> None:
        """The op ran before its outputs were placed: move them (and mutated storages the core
        gave new blocks) into the arena."""
        graph, homes = self.runtime.graph, self.homes
        held = sum(graph.nbytes[s] for s in record.outputs if graph.nbytes[s] and self.pool.holds(s))
        self.beside(held + record.op.scratch, record.op.name)  # ran already: one not sized ahead
        moved = False
        for storage in record.outputs:
            if graph.nbytes[storage] and self.pool.holds(storage):
                self._move_into(storage, homes.get(storage))
                moved = True
        if moved and n_fresh:
            self.copied.add(record.op.name)

    # -- recomputations -------------------------------------------------------------------------

    def _rerun(self, record: Record, recipe: Recipe) -> None:
        runtime, homes = self.runtime, self.homes
        graph, resident = runtime.graph, runtime.resident
        targets: dict[int, torch.UntypedStorage] = {}
        moved: set[int] = set()
        for new, old in zip(record.outputs, record.reuse, strict=True):
            if old == NO_REUSE:
                continue
            real = homes.get(old)
            if graph.nbytes[new] == 0:
                targets[old] = real.clone()
            elif (
                not resident[new] and not self.pool.holds(new) and not self.pool.holds(owners.transient(new))
            ):
                targets[old] = real  # in place: the new version takes over the old block
                moved.add(new)
            else:
                targets[old] = self.block(new, real.nbytes())
                targets[old].copy_(real)

        def source(storage: int) -> torch.UntypedStorage:
            found = targets.get(storage)
            return found if found is not None else homes.get(storage)

        fresh = [s for s, old in zip(record.outputs, record.reuse, strict=True) if old == NO_REUSE]
        found = self._out(recipe.func)
        if found is not None and len(found[1]) != len(fresh):
            found = None
        leaves = self._meta_leaves(recipe) if fresh and found is not None else None
        placed: dict[int, torch.UntypedStorage] = {}
        copies = 0
        if found is None or leaves is None or self._wraps(found[0]):
            copies = sum(graph.nbytes[s] for s in fresh)
        self.beside(record.op.scratch + copies, record.op.name)
        if found is not None and leaves is not None:
            overload, names = found
            outs = {}
            for name, storage, position in zip(names, fresh, recipe.outputs, strict=True):
                outs[name] = self._tensor_at(storage, leaves[position])
                placed[storage] = outs[name].untyped_storage()
            out, seconds = recipe.run(source, self.device, overload, outs)
        else:
            out, seconds = recipe.run(source, self.device)
            if fresh:
                self.copied.add(record.op.name)
        self.recompute_seconds += seconds
        leaves = [value for _, value in result_leaves(recipe.returns, out)]
        positions = dict(zip(fresh, recipe.outputs, strict=True))
        for storage, old in zip(record.outputs, record.reuse, strict=True):
            if resident[storage] or graph.nbytes[storage] == 0:
                continue
            if old != NO_REUSE:
                content = targets[old]
                if storage in moved:
                    homes.forget(old)
            elif storage in placed:
                content = placed[storage]
            else:
                computed = leaves[positions[storage]].untyped_storage()
                content = self.block(storage, computed.nbytes())
                content.copy_(computed)
            self._install(storage, content)

    def _meta_leaves(self, recipe: Recipe) -> list[Any] | None:
        """The recomputed op's results on meta tensors, to place them in the arena; None where no
        meta kernel can tell them (``nonzero``, whose size depends on the data; an op of
        ``NO_META``): then it runs beside the arena and its results are copied in."""
        func = recipe.func
        if not self.placeable(func):
            return None
        try:
            out = recipe.meta()
        except (NotImplementedError, RuntimeError):
            return None
        return [value for _, value in result_leaves(recipe.returns, out)]

    # -- the end --------------------------------------------------------------------------------

    def handing_over(self, handles: list[int]) -> None:
        """What the program keeps is copied out of the arena while the arena is still allocated
        (constants written in the region go back to their own memory instead): the reserve must
        hold the copies. Raises before copying anything when it cannot."""
        homes = self.homes
        held = [homes.storage_of_handle(h) for h in handles]
        moved = [homes.storage_of_handle(h) for h in homes.pinned if h not in self.homes_of]
        needed = sum(real.nbytes() for real in held + moved if real is not None and self._inside(real))
        self.beside(needed, "the hand-over of what the program keeps")

    def hand_over(self, storage: int) -> None:
        """The program keeps ``storage``: copy it out of the arena, which dies with the region."""
        self._copy_out(self.homes.get(storage))
        self.homes.forget(storage)

    def close(self) -> None:
        """Constants written in the region go back to their own memory (copied), what else the
        program holds in the arena out of it."""
        for handle, real in self.homes.pinned.items():
            home = self.homes_of.get(handle)
            if home is not None and self._inside(real) and home.nbytes() == real.nbytes():
                home.copy_(real)
                swap(real, home)
            else:
                self._copy_out(real)
        for handle in list(self.homes.program):
            held = self.homes.storage_of_handle(handle)
            if held is not None:
                self._copy_out(held)
        self.homes_of.clear()

    def _copy_out(self, real: torch.UntypedStorage) -> None:
        if not self._inside(real):
            return
        own = torch.UntypedStorage(real.nbytes(), device=self.device)
        own.copy_(real)
        swap(real, own)
