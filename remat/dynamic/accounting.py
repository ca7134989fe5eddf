"""The ``accounting`` memory backend: tensors live in PyTorch's allocator, the core's pool keeps the
accounts and takes every decision, exactly as in the simulator.

The pool makes room for an op's outputs before the op runs (NOTE [room first] in ``engine``), so
that the allocator never holds more than the pool counts, beyond the region's reserve. The pool may
model addresses (``layout=True``, for Coop and fragmentation) although PyTorch places the tensors
where it likes: the layout is the pool's, not the allocator's. The ``arena`` backend
(:mod:`remat.dynamic.arena`) makes the layout real.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from remat._errors import RecomputationError
from remat.aten import UNSAID_VIEWS, scratch
from remat.core import owners
from remat.core.driver import ThrashMeter
from remat.core.graph import NO_REUSE, Record
from remat.core.pool import Pool
from remat.dynamic.backends import register
from remat.dynamic.homes import Homes, aligned
from remat.dynamic.op_bytes import resized
from remat.dynamic.recipe import Recipe, result_leaves
from remat.dynamic.sizing import BOUNDED, bound, depends_on_data, meta, meta_results, room_for
from remat.host.pool import HostPool

# Run first, sized after: the oneDNN RNN layer, whose meta kernel reports an empty workspace;
# ``_unsafe_view``, whose schema promises a new tensor but which returns a view of its input; CUDA's
# fused attention kernels, whose dropout seed and offset come back as CPU tensors where the meta
# kernels put them on the device; every op whose real results differed from its meta ones.
NO_META = {
    "aten::mkldnn_rnn_layer",
    "aten::_pack_padded_sequence",  # its batch_sizes is left out of the pool (``aten.READ_OUTSIDE_OPS``)
    "aten::_unsafe_view",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_efficient_attention_forward",
    "aten::_flash_attention_forward",
}
# of those, the ones whose results may share an input's storage (more are learned as they are met)
ALIASING = {packet.replace(".", "::", 1) for packet in UNSAID_VIEWS}

_METAS: dict[tuple[Any, ...], list[torch.Tensor | None] | None] = {}  # by op signature (``plan``)
_UNKNOWN: Any = object()  # a signature not in _METAS yet


class Pending:
    """A first run on its way into the core: what :meth:`AccountingBackend.materialize` adopts."""

    __slots__ = (
        "fresh",
        "written",
        "saved",
        "recipe",
        "run",
        "metas",
        "measure",
        "out",
        "seconds",
        "learn",
        "states",
    )

    def __init__(self, fresh: list[int], written: list[int], saved: dict[int, torch.UntypedStorage]) -> None:
        self.fresh = fresh  # handles of the fresh outputs, in op order
        self.written = written  # mutated handles, in op order
        self.saved = saved  # mutated handle -> copy of the old content taken before the run
        self.recipe: Recipe | None = None
        self.run: Callable[[Record], tuple[Any, float]] | None = None  # backends that run in materialize
        self.metas: list[Any] = []  # meta results of an op the backend runs (sizes of its outputs)
        self.measure = False  # the core's cost of the op is its time, known once run
        self.out: Any = None
        self.seconds = 0.0
        self.learn: tuple[Any, ...] | None = None  # the op's scratch signature, to learn at its run
        # the generator states the recipe keeps, taken when the op runs here (NOTE [room first])
        self.states: Callable[[], tuple[Any, Any]] | None = None


@register
class AccountingBackend:
    """Runs and re-runs ops on real tensors for :class:`~remat.core.runtime.Runtime`."""

    name = "accounting"
    places = False  # the pool's addresses are a model: PyTorch's allocator places the tensors
    bounds = True  # an op sized by the most it can make is placed so (NOTE [bounded ops])
    unreturned = True  # an op with a result it does not return may be placed before it runs

    @classmethod
    def create(cls, device: torch.device, thrash_limit: float, pool: Pool, reserve: int) -> AccountingBackend:
        """The backend of one region (the pool and the reserve are PyTorch's allocator's business)."""
        return cls(device, thrash_limit)

    def __init__(self, device: torch.device, thrash_limit: float) -> None:
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.homes = Homes()
        self.recipes: dict[int, Recipe] = {}
        self.handle_of: dict[int, int] = {}  # core storage -> the handle it was made for
        self.runtime: Any = None  # set by the engine once the runtime exists
        self.pending: Pending | None = None
        self.meter = ThrashMeter(thrash_limit)  # first runs are added as they run
        self.recompute_seconds = 0.0  # recomputations: measured time of the ops themselves
        self.moments: list[tuple[int, str]] = []  # (time.time_ns(), "evict" | "recompute")
        self.host = HostPool()  # swapped storages' bytes (remat.core.swap), out of the device's count
        self.made_less: dict[int, int] = {}  # storage -> the bytes its first run made, below its count
        self.on_host: dict[int, torch.Tensor] = {}

    # -- the core's side ------------------------------------------------------------------------

    def materialize(self, record: Record, recompute: bool) -> float:
        if not recompute:
            return self._adopt(record)
        self.moments.append((time.time_ns(), "recompute"))
        self._rerun(record, self.recipes[record.id])
        self.meter.recomputed(record.op.cost)
        return record.op.cost

    def free(self, storage: int) -> None:
        self.homes.evict(storage)

    def plan(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        fresh_returns: tuple[bool, ...],
        key: tuple[Any, ...],
        sized: bool = False,
    ) -> list[Any] | None:
        """The meta results of an op the backend runs in :meth:`materialize` once the core has placed
        them (NOTE [room first]); None: the engine runs the op first (see also ``unreturned``).
        ``key``: the op's signature (``remat.aten.scratch``), under which its meta results are kept
        for the next call (a meta kernel in Python can cost more than the op). ``sized``: its
        results' sizes are known from an earlier run, whatever its meta kernel says."""
        if not any(fresh_returns):
            return []
        if not all(fresh_returns) or not self.placeable(func, sized):
            return None
        metas = _METAS.get(key, _UNKNOWN)
        if metas is _UNKNOWN:
            metas = _METAS[key] = meta_results(func, args, kwargs, fresh_returns)
        if metas is None and self.bounds:  # NOTE [bounded ops] in ``remat.dynamic.sizing``
            metas = bound(func, args, kwargs)
            if metas is not None and not room_for(self.runtime, metas, args):
                metas = None
        return None if metas and not self.unreturned and any(m is None for m in metas) else metas

    def learned(
        self,
        func: Any,
        key: tuple[Any, ...],
        returns: tuple[bool, ...],
        out: Any,
        sizes: tuple[int, ...],
        args: Any,
    ) -> None:
        """An op run before it was placed made results of ``sizes`` bytes, kept for the next call of
        its signature ``key``. Where its meta kernel refused it (``_grouped_mm`` in float32, which its
        meta kernel does not take) and its results' sizes do not depend on the data, their geometry
        stands in for its meta results from then on, so that the core places them before it runs
        (NOTE [room first]); a size that turns out otherwise is caught when it runs. Sizes that
        depend on the data (``args``' values) are not kept: the next call's may be larger."""
        if depends_on_data(func, args):
            return
        scratch.learn_results(key, sizes)
        if key not in _METAS or _METAS[key] is not None:
            return
        leaves = [value for _, value in result_leaves(returns, out)]
        kept = [t for t in leaves if t is not None]  # None: a result the op does not return
        if all(returns) and all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in kept):
            _METAS[key] = [None if t is None else meta(t) for t in leaves]

    def placeable(self, func: Any, sized: bool = False) -> bool:
        """Whether ``func``'s meta results may be trusted for its real ones (their sizes aside,
        when ``sized``)."""
        name = func._schema.name
        return name not in NO_META or (sized and name not in ALIASING)

    def first_run(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        record: Record,
        pending: Pending,
        bind: Callable[[int, torch.Tensor], bool],
    ) -> tuple[Any, float]:
        """Run an op the core has just placed: keep the old content of what it writes where the
        core gave the new version memory of its own, then run it as the program asked. A result
        that turns out to share an existing storage is not bound (its handle is released at once)
        and the op runs first from then on."""
        n = len(pending.fresh)
        graph, homes, pool = self.runtime.graph, self.homes, self.runtime.pool
        if pending.written:
            for new, old, handle in zip(record.outputs[n:], record.reuse[n:], pending.written, strict=True):
                if graph.nbytes[new] > 0 and pool.holds(new):
                    pending.saved[handle] = self.copy_of(homes.get(old))
        out, seconds = scratch.timed(lambda: func(*args, **kwargs), pending.learn)
        for new, handle in zip(record.outputs[n:], pending.written, strict=True):
            real = homes.storage_of_handle(handle)
            if real is not None and aligned(real.nbytes()) != graph.nbytes[new]:  # ``resize_``, ``out=``
                raise resized(func, graph.nbytes[new], real.nbytes())
        assert pending.recipe is not None
        leaves = [v for _, v in result_leaves(pending.recipe.returns, out) if v is not None] if n else []
        device, on_cpu = self.device, self.on_cpu
        for handle, leaf, storage in zip(pending.fresh, leaves, record.outputs[:n], strict=True):
            here = isinstance(leaf, torch.Tensor) and (
                leaf.is_cpu
                if on_cpu
                else leaf.device.type == device.type and device.index in (None, leaf.device.index)
            )
            if not here:
                NO_META.add(func._schema.name)  # the next call runs it first
                where = leaf.device if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                raise RecomputationError(
                    f"remat.dynamic: {func} returned a result on {where} where its meta kernel "
                    f"returned one on the region's device {device}; please report this op"
                )
            if not bind(handle, leaf):
                NO_META.add(func._schema.name)
                ALIASING.add(func._schema.name)
            elif (made := aligned(leaf.untyped_storage().nbytes())) != graph.nbytes[storage]:
                if made < graph.nbytes[storage]:  # counted high: no risk; a recomputation makes ``made``
                    self.made_less[storage] = made
                if made > graph.nbytes[storage] or func._schema.name not in BOUNDED:
                    NO_META.add(func._schema.name)  # eval batch norm's empty statistics: run first
                if made > graph.nbytes[storage]:
                    warnings.warn(
                        f"remat.dynamic: {func}'s meta kernel sized its result "
                        f"{graph.nbytes[storage]} bytes, it made {leaf.untyped_storage().nbytes()}; "
                        "from now on it runs before it is placed",
                        stacklevel=2,
                    )
        return out, seconds

    def ahead(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        fresh_returns: tuple[bool, ...],
        key: tuple[Any, ...],
        saved: dict[int, torch.UntypedStorage],
    ) -> None:
        """An op is about to run before its outputs are placed, ``saved`` copied aside for it: its
        results and scratch are the reserve's to cover, as the core evicts for them just after."""

    def placed(self, record: Record, n_fresh: int) -> None:
        """A first run that ran before the core placed its outputs is adopted (nothing to move)."""

    def open(self) -> None:
        """The constants given in ``keep`` are registered: the program's first op comes next."""

    def handing_over(self, handles: list[int]) -> None:
        """The program keeps ``handles``, all resident: raise here if handing them over cannot be
        done within the budget."""

    def hand_over(self, storage: int) -> None:
        """Resident ``storage`` leaves the pool; the program keeps its content (NOTE [hand-over])."""
        self.homes.forget(storage)

    def close(self) -> None:
        """The region ends: nothing of this backend outlives it."""

    # -- first runs -----------------------------------------------------------------------------

    # -- swapping: the host store of remat.core.swap -------------------------------------------

    def swap_out(self, storage: int) -> None:
        real = self.homes.get(storage)
        buffer = self.host.take(real.nbytes(), pinned=self.device.type == "cuda")
        buffer.copy_(_as_bytes(real))
        self.on_host[storage] = buffer

    def swap_in(self, storage: int) -> None:
        buffer = self.on_host[storage]
        content = torch.UntypedStorage(buffer.numel(), device=self.device)
        _as_bytes(content).copy_(buffer)
        self._install(storage, content)

    def drop(self, storage: int) -> None:
        self.host.give(self.on_host.pop(storage), pinned=self.device.type == "cuda")

    def copy_of(self, real: torch.UntypedStorage) -> torch.UntypedStorage:
        """A copy of ``real``'s bytes, to keep an old version while an op overwrites it."""
        return real.clone()

    def _adopt(self, record: Record) -> float:
        pending = self.pending
        assert pending is not None and pending.recipe is not None
        self.pending = None
        ran_here = pending.run is not None
        if pending.run is not None:
            if pending.states is not None:  # its room is made: the states may be taken now
                rng, generators = pending.states()
                pending.recipe = pending.recipe._replace(rng=rng, generators=generators)
                pending.states = None
            pending.out, pending.seconds = pending.run(record)
            pending.run = None  # it refers to ``pending``: no cycle may keep the outputs alive
            if pending.measure:
                self.runtime.graph.set_cost(record, pending.seconds)
        self.recipes[record.id] = pending.recipe
        homes, handle_of = self.homes, self.handle_of
        n = len(pending.fresh)
        for storage, handle in zip(record.outputs[:n], pending.fresh, strict=True):
            handle_of[storage] = handle
            homes.hold(storage, handle)
        pool = self.runtime.pool
        for storage, old, handle in zip(record.outputs[n:], record.reuse[n:], pending.written, strict=True):
            self.handle_of[storage] = handle
            copy = pending.saved.get(handle)
            took_over = not pool.holds(storage)
            homes.forget(old)
            # A copy made before the run (constants, or where the core may copy) is dropped if the
            # new version took over the old memory after all.
            if self.runtime.graph.nbytes[storage] > 0 and not took_over:
                if copy is None:
                    raise AssertionError(f"the core kept storage {old} but no copy of it was made")
                homes.keep_private(old, copy)
            homes.hold(storage, handle)
        if not ran_here:
            self.placed(record, n)
        self.meter.first(record.op.cost)
        return record.op.cost

    # -- recomputations -------------------------------------------------------------------------

    def _rerun(self, record: Record, recipe: Recipe) -> None:
        runtime, homes = self.runtime, self.homes
        pool, graph, resident = runtime.pool, runtime.graph, runtime.resident
        targets: dict[int, torch.UntypedStorage] = {}
        moved: list[tuple[int, int]] = []  # (new, old): the new version took over old's memory
        for new, old in zip(record.outputs, record.reuse, strict=True):
            if old == NO_REUSE:
                continue
            real = homes.get(old)
            if (
                graph.nbytes[new] > 0
                and not resident[new]
                and not pool.holds(new)
                and not pool.holds(owners.transient(new))
            ):
                targets[old] = real  # in place, as Coop
                moved.append((new, old))
            else:
                targets[old] = self.copy_of(real)

        def source(storage: int) -> torch.UntypedStorage:
            found = targets.get(storage)
            return found if found is not None else homes.get(storage)

        out, seconds = recipe.run(source, self.device)
        self.recompute_seconds += seconds
        leaves = [value for _, value in result_leaves(recipe.returns, out)]
        fresh = iter(recipe.outputs)
        for storage, old in zip(record.outputs, record.reuse, strict=True):
            position = next(fresh) if old == NO_REUSE else -1
            if resident[storage] or graph.nbytes[storage] == 0:
                continue
            if old == NO_REUSE:
                content = leaves[position].untyped_storage()
            else:
                content = targets[old]
                if (storage, old) in moved:
                    homes.forget(old)
            self._install(storage, content)

    def _install(self, storage: int, content: torch.UntypedStorage) -> None:
        expected = self.runtime.graph.nbytes[storage]
        if aligned(content.nbytes()) not in (expected, self.made_less.get(storage)):
            raise RecomputationError(
                f"remat.dynamic: an op run again made another size than its first run (storage "
                f"{storage}: {content.nbytes()} bytes, {expected} the first time); it reads state "
                "its arguments do not carry: run it under remat.plainly(), and please report the op"
            )
        # Only the current version of a storage the program still holds goes back under the
        # program's storage; a dead or handed-over one (NOTE [hand-over]) stays private.
        handle = self.handle_of.get(storage)
        runtime = self.runtime
        current = handle is not None and runtime.live[storage] > 0 and runtime.storage_of(handle) == storage
        self.homes.install(storage, content, handle if current else None)


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The bytes of ``storage`` as a flat ``uint8`` tensor over the same memory."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
