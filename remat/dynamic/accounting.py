"""The ``accounting`` memory backend: tensors live in PyTorch's allocator, the core's pool keeps the
accounts and takes every decision, exactly as in the simulator.

An op runs as the program asks for it; the pool then makes room for its outputs by evicting, so the
real bytes can pass the budget by one op's outputs between the two (the pool's count never does).
The pool may model addresses (``layout=True``, for Coop and fragmentation) although PyTorch places
the tensors where it likes: the layout is the pool's, not the allocator's. The ``arena`` backend
(:mod:`remat.dynamic.arena`) makes the layout real.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from remat.core.graph import NO_REUSE, Record
from remat.dynamic.homes import Homes, aligned
from remat.dynamic.recipe import Recipe, result_leaves


class Thrashing(Exception):
    """Recomputation passed the thrash limit."""


class Pending:
    """A first run on its way into the core: what :meth:`Backend.materialize` adopts."""

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


class Backend:
    """Runs and re-runs ops on real tensors for :class:`~remat.core.runtime.Runtime`."""

    name = "accounting"
    grows = True  # NOTE [hand-over]

    def __init__(self, device: torch.device, thrash_limit: float) -> None:
        self.device = device
        self.homes = Homes()
        self.recipes: dict[int, Recipe] = {}
        self.handle_of: dict[int, int] = {}  # core storage -> the handle it was made for
        self.runtime: Any = None  # set by the engine once the runtime exists
        self.pending: Pending | None = None
        self.thrash_limit = thrash_limit
        self.base_cost = 0.0  # first runs, at the cost the core counts
        self.recompute_cost = 0.0  # recomputations, at the cost the core counts
        self.recompute_seconds = 0.0  # recomputations: measured time of the ops themselves
        self.recomputed_ops = 0

    # -- the core's side ------------------------------------------------------------------------

    def materialize(self, record: Record, recompute: bool) -> float:
        if not recompute:
            return self._adopt(record)
        self._rerun(record, self.recipes[record.id])
        self.recompute_cost += record.op.cost
        self.recomputed_ops += 1
        if self.recompute_cost > (self.thrash_limit - 1.0) * self.base_cost:
            raise Thrashing
        return record.op.cost

    def free(self, storage: int) -> None:
        self.homes.evict(storage)

    def plan(self, func: Any, args: Any, kwargs: Any, fresh_returns: tuple[bool, ...]) -> list[Any] | None:
        """None: the engine runs the op before the core places its outputs (this backend);
        else the meta results of an op the backend runs in :meth:`materialize`."""
        return None

    def first_run(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        record: Record,
        pending: Pending,
        bind: Callable[[int, torch.Tensor], None],
    ) -> tuple[Any, float]:
        raise NotImplementedError  # only backends whose ``plan`` returns results run ops themselves

    def placed(self, record: Record, n_fresh: int) -> None:
        """A first run that ran before the core placed its outputs is adopted (nothing to move)."""

    def hand_over(self, storage: int) -> None:
        """Resident ``storage`` leaves the pool; the program keeps its content (NOTE [hand-over])."""
        self.homes.forget(storage)

    def close(self) -> None:
        """The region ends: nothing of this backend outlives it."""

    # -- first runs -----------------------------------------------------------------------------

    def copy_of(self, real: torch.UntypedStorage) -> torch.UntypedStorage:
        """A copy of ``real``'s bytes, to keep an old version while an op overwrites it."""
        return real.clone()

    def _adopt(self, record: Record) -> float:
        pending = self.pending
        assert pending is not None and pending.recipe is not None
        self.pending = None
        ran_here = pending.run is not None
        if pending.run is not None:
            pending.out, pending.seconds = pending.run(record)
            pending.run = None  # it refers to ``pending``: no cycle may keep the outputs alive
            if pending.measure:
                self.runtime.graph.set_cost(record, pending.seconds)
        self.recipes[record.id] = pending.recipe
        homes, pool = self.homes, self.runtime.pool
        n = len(pending.fresh)
        for storage, handle in zip(record.outputs[:n], pending.fresh, strict=True):
            self.handle_of[storage] = handle
            homes.hold(storage, handle)
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
        self.base_cost += record.op.cost
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
                and not pool.holds(-2 - new)
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
        if aligned(content.nbytes()) != expected:
            from remat._errors import RecomputationError

            raise RecomputationError(
                f"recomputing storage {storage} gave {content.nbytes()} bytes instead of {expected}"
            )
        # Only the current version of a storage the program still holds goes back under the
        # program's storage; a dead or handed-over one (NOTE [hand-over]) stays private.
        handle = self.handle_of.get(storage)
        runtime = self.runtime
        current = handle is not None and runtime.live[storage] > 0 and runtime.storage_of(handle) == storage
        self.homes.install(storage, content, handle if current else None)
