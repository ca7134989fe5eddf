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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from remat.core.graph import NO_REUSE, Record
from remat.core.pool import AddressPool
from remat.dynamic.accounting import Backend, Pending
from remat.dynamic.homes import at, swap
from remat.dynamic.recipe import Recipe, result_leaves

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


class ArenaBackend(Backend):
    """Places outputs in one preallocated buffer at the pool's addresses."""

    name = "arena"

    def __init__(self, device: torch.device, thrash_limit: float, pool: AddressPool) -> None:
        super().__init__(device, thrash_limit)
        self.pool = pool
        self.size = pool.capacity
        self.arena = torch.empty(self.size, dtype=torch.uint8, device=device)
        self.base = self.arena.data_ptr()
        self.copied: set[str] = set()
        self._outs: dict[Any, OutOverload | None] = {}

    # -- addresses ------------------------------------------------------------------------------

    def block(self, storage: int, nbytes: int) -> torch.UntypedStorage:
        """A non-owning storage of ``nbytes`` at the arena block holding ``storage`` (or its
        by-product)."""
        owner = storage if self.pool.holds(storage) else -2 - storage
        return at(self.base + self.pool.address(owner), self.device, nbytes)

    def _inside(self, real: torch.UntypedStorage) -> bool:
        """Whether ``real`` has bytes in the arena (a ghost, NOTE [ghosts], has none)."""
        if real.nbytes() == 0:
            return False
        try:
            pointer = real.data_ptr()
        except RuntimeError:
            return False
        return self.base <= pointer < self.base + self.size

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

    # -- first runs -----------------------------------------------------------------------------

    def placeable(self, func: Any, sized: bool = False) -> bool:
        return super().placeable(func, sized) and self._out(func) is not None

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
        outs: dict[str, torch.Tensor] = {}
        if n:
            overload, names = self._out(func)  # type: ignore[misc]
            for name, storage, handle, meta in zip(
                names, record.outputs[:n], pending.fresh, pending.metas, strict=True
            ):
                outs[name] = self._tensor_at(storage, meta)
                bind(handle, outs[name])
            func = overload
        start = time.perf_counter()
        out = func(*args, **kwargs, **outs)
        return out, time.perf_counter() - start

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
            elif not resident[new] and not self.pool.holds(new) and not self.pool.holds(-2 - new):
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
        placed: dict[int, torch.UntypedStorage] = {}
        if fresh and found is not None and len(found[1]) == len(fresh):
            overload, names = found
            leaves = [value for _, value in result_leaves(recipe.returns, recipe.meta())]
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

    # -- the end --------------------------------------------------------------------------------

    def hand_over(self, storage: int) -> None:
        """The program keeps ``storage``: copy it out of the arena, which dies with the region."""
        self._copy_out(self.homes.get(storage))
        self.homes.forget(storage)

    def close(self) -> None:
        """Constants the region moved into the arena (updated parameters) go back out."""
        for real in self.homes.pinned.values():
            self._copy_out(real)
        for handle in list(self.homes.program):
            held = self.homes.storage_of_handle(handle)
            if held is not None:
                self._copy_out(held)

    def _copy_out(self, real: torch.UntypedStorage) -> None:
        if not self._inside(real):
            return
        own = torch.UntypedStorage(real.nbytes(), device=self.device)
        own.copy_(real)
        swap(real, own)
