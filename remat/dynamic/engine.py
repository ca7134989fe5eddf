"""One dynamic region at work: a dispatch mode that feeds every ATen op to the rematerialization
core and hands the core's decisions to a memory backend.

Why a dispatch mode: it sits below autograd, so it sees the forward ops, the backward ops the engine
runs and the optimizer's in-place updates alike, on plain tensors (no subclass the program or
autograd could notice), and it runs before the kernel, so an evicted input is restored just in time.

NOTE [identity] The unit of memory is a PyTorch storage. Each storage seen in the region gets one
handle for the core (:class:`~remat.core.runtime.Runtime`): an op output on a new storage makes a
fresh handle, a storage that existed before the region becomes a constant the first time an op
reads it (kept alive until the region ends, since recomputations may read it), views share their
base's handle, and a mutation moves the handle to a new version inside the core. Ops whose results
are all views of their inputs (``view``, ``t``, ``expand`` ...) read no data and never reach the
core: a view of an evicted tensor stays evicted until something reads it.

NOTE [releases] A weak reference with a callback on each fresh storage tells when the program
(autograd included) drops its last tensor on it. The release is queued and given to the core at
the next op boundary, never in the middle of a decision of the core. The cycle collector is
paused for the whole region (the region turns it back on at its end): it could free a program
storage in the middle of an op, one the core may be about to read for a recomputation, and it runs
at moments that depend on the history of the process, which would make the releases, and hence the
decisions, differ from run to run. Tensors caught in reference cycles stay until the region ends.

NOTE [hand-over] At the end of the region every storage the program still holds is handed back
to it: the core restores the evicted ones while the others stay, so that all are resident at once
within the budget (a budget that cannot hold them fails here, before memory passes it), then each
is taken out of the pool (as if released) while the program keeps the content. Rebuilding an
evicted one can mean recomputing a chain of dead tensors (a gradient needs the backward pass that
made it), so the gradients of the leaves the region reads are wanted at the end
(:mod:`remat.dynamic.wanted`), evicted only as a last resort. Recomputations here are reported
apart (``exit_recomputations``) and the thrash limit counts them apart: the hand-over may cost up
to ``thrash_limit - 1`` times the step's first runs again. The hand-over is not in the trace: the
simulator's ``finish`` does the same with what the trace leaves live.

NOTE [room first] The pool makes room for an op's outputs before the op runs, so that memory never
holds more than the pool counts: the op's results are first computed on meta tensors for their
sizes (``AccountingBackend.plan``), the core evicts and places them, and the backend runs the op. The
generator states a random op's recipe keeps are taken then too, just before it runs (their size is
known beforehand: ``remat.aten.state_nbytes``). An op whose results cannot be sized that way (no
meta kernel, data-dependent sizes with no bound: NOTE [bounded ops], results on another device,
``NO_META``'s ops) runs first and is placed after (beyond the pool's count until the core evicts for
them: the reserve's); where a meta kernel refused the arguments, that run's results stand in (``learned``).

NOTE [same decisions] Each op is handed to the core as the simulator hands a trace op: ``call``
with the outputs' sizes and the op's recorded cost. The clock of the core moves by recorded costs,
in first runs and recomputations alike, so what the core decides depends only on the recorded
events; ``trace()`` gives them back as a :class:`~remat.trace.types.Trace` for the simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from remat import _allocator, aten
from remat.aten import OpFacts, RngState
from remat.aten import scratch as op_scratch
from remat.core.driver import Thrashed
from remat.core.policies.base import EvictionPolicy
from remat.core.pool import OutOfMemory, Pool
from remat.core.runtime import Runtime
from remat.dynamic.accounting import AccountingBackend, Pending
from remat.dynamic.homes import aligned
from remat.dynamic.op_bytes import recompute_bytes, state_bytes
from remat.dynamic.recipe import Recipe, Slot, flatten, result_leaves, scan
from remat.dynamic.wanted import watch
from remat.trace.cost import op_cost
from remat.trace.types import Event, Op, Release, TensorInfo, Trace


class Engine:
    """The state of one region: identity of storages, the core runtime, the recorded events."""

    def __init__(
        self,
        pool: Pool,
        policy: EvictionPolicy,
        backend: AccountingBackend,
        device: torch.device,
        estimated: bool,
    ) -> None:
        self.runtime = backend.runtime = Runtime(pool, policy, backend, compact=not backend.places)
        self.backend, self.device, self.on_cpu = backend, device, device.type == "cpu"
        self.handles: dict[int, int] = {}  # storage key -> handle
        self.tensors: list[TensorInfo] = []
        self.events: list[Event] = []
        self.released: list[int] = []  # handles the program let go of, for the next op boundary
        self.wanting: list[int] = []  # handles wanted at the end, given to the core at the next boundary
        self.current: str = ""  # the op being run, for errors
        self.peak_real_bytes = self.ops = 0
        self.unmeasured = 0  # ops run with their kernel's scratch unknown, counted as 0 (NOTE [held back])
        self.unsized = (0, "")  # the most an op made before it was placed (NOTE [room first]), and its op
        self.estimated, self.base_seconds = estimated, 0.0  # and the first runs of the ops, measured
        self.marks, self.peak_in_program = (0, 0), 0  # evictions and recomputations at the last op
        self.recompute_marks = (0.0, 0.0)  # recomputation seconds and cost at the same moment
        self.explain: Callable[[BaseException], Exception] = _plain
        self.failed = False  # an op failed and the step was undone: ops run as plain PyTorch
        self.entry: dict[int, int] = {}  # constant handle -> its core storage when registered
        self.hidden: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> it, its entry content
        self.outside_bytes = 0  # bytes of the storages from before the region (constants)
        self.moments: list[tuple[int, str]] = backend.moments  # (time.time_ns(), "evict" | "recompute")
        self.hooks: list[RemovableHandle] = []  # of :func:`remat.dynamic.wanted.watch`, removed at close
        self.watched: set[int] = set()  # the leaves they watch, by id
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # the program's, at entry

    def managed(self, t: torch.Tensor) -> bool:
        if self.on_cpu:  # the same test, cheaper: on every tensor argument of every op
            return t.is_cpu and t.layout == torch.strided
        return t.device == self.device and t.layout == torch.strided and not t.is_meta

    def constant(self, t: torch.Tensor, outside: bool = True) -> int:
        """The storage of ``t`` is from outside the region (``outside``; else a tensor the region
        keeps for itself): a constant of the core, kept alive (NOTE [identity])."""
        storage = t.untyped_storage()
        handle = len(self.tensors)
        nbytes = aligned(storage.nbytes())
        self.tensors.append(TensorInfo(handle, nbytes, None, True, tuple(t.shape), aten.dtype_name(t.dtype)))
        self.handles[storage._cdata] = handle
        self.backend.homes.add_handle(handle, storage, pin=True)
        self.runtime.constant(handle, nbytes)
        core = self.runtime.storage_of(handle)
        if outside:  # its gradient, if it is a leaf, is wanted at the end (``remat.dynamic.wanted``)
            self.entry[handle] = core
            self.outside_bytes += nbytes
            self.hooks += watch((t,), self.wanted, self.watched)
        self.backend.handle_of[core] = handle
        self.backend.homes.hold(core, handle)
        return handle

    def handle(self, t: torch.Tensor) -> int:
        handle = self.handles.get(t.untyped_storage()._cdata)
        return self.constant(t) if handle is None else handle

    def new_handle(self, t: torch.Tensor, nbytes: int) -> int:
        """A handle for a new storage of ``nbytes`` that ``t`` (real or meta) describes."""
        handle = len(self.tensors)
        info = TensorInfo(handle, aligned(nbytes), None, False, tuple(t.shape), aten.dtype_name(t.dtype))
        self.tensors.append(info)
        return handle

    def bind(self, handle: int, t: torch.Tensor) -> bool:
        """The new storage of ``handle`` is ``t``'s: follow it until the program drops it. False
        when ``t``'s storage is not new after all (a view): the handle is released at once."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.handles:
            self.released.append(handle)
            return False
        self.handles[key] = handle
        self.backend.homes.add_handle(handle, storage, pin=False, died=lambda _: self._died(key, handle))
        return True

    def wanted(self, t: torch.Tensor) -> None:
        """The program holds ``t`` at the region's end (:mod:`remat.dynamic.wanted`)."""
        if (handle := self.handles.get(t.untyped_storage()._cdata)) is not None and not self.failed:
            self.wanting.append(handle)

    def _died(self, key: int, handle: int) -> None:
        if self.handles.get(key) == handle:
            del self.handles[key]
        self.released.append(handle)

    def flush(self) -> None:
        """Give queued releases, then queued marks (:meth:`wanted`), to the core (NOTE [releases]):
        between the same events as the simulator that replays the marks (``Residency.expect``)."""
        released, events, release = self.released, self.events, self.runtime.release
        while released:
            handle = released.pop(0)
            events.append(Release(handle))
            release(handle)
        while self.wanting:
            self.runtime.want(self.wanting.pop(0))

    # -- ops ------------------------------------------------------------------------------------

    def run(self, func: Any, schema: OpFacts, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if self.failed:
            return func(*args, **kwargs)
        try:
            return self._run(func, schema, args, kwargs)
        except (OutOfMemory, Thrashed) as failure:
            raise self.explain(failure) from None

    def _run(self, func: Any, schema: OpFacts, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if self.released or self.wanting:
            self.flush()
        flat, spec = flatten(args, kwargs)
        positions, explicit, named, leaves, tensors = scan(flat, self.managed)
        if not positions and (tensors or not self._outputs_here(named, False)):
            return func(*args, **kwargs)  # another device's tensors or results: not the region's memory
        runtime, backend = self.runtime, self.backend
        self.current = schema.name
        # Each tensor argument's handle (a storage first read here becomes a constant, in argument
        # order) and its slot in the recipe: the storage version it reads and its geometry.
        known, storage_of, geometry = self.handles, runtime.storage_of, aten.geometry
        handles: list[int] = []
        slots: list[Slot] = []
        for i in positions:
            t = flat[i]
            handle = known.get(t.untyped_storage()._cdata)
            if handle is None:
                handle = self.constant(t)
            handles.append(handle)
            slots.append(Slot(i, storage_of(handle), *geometry(t), t.is_conj() + 2 * t.is_neg()))
        if schema.hidden_writes:
            handles += self._note_hidden(schema, args, kwargs)
        inputs = tuple(dict.fromkeys(handles))
        runtime.prepare(inputs)
        written = self._written(schema, args, kwargs) if schema.writes else []
        key = op_scratch.signature_of(schema.name, flat, schema.pointwise)
        sizes = op_scratch.results(key)
        metas = None  # NOTE [room first]
        if (positions and not named) or self._outputs_here(named, bool(positions)):
            metas = backend.plan(func, args, kwargs, schema.fresh_returns, key, sized=sizes is not None)
        positions_out = [i for i, m in enumerate(metas or ()) if m is not None]  # a None: no result
        metas = [metas[i] for i in positions_out] if metas is not None else None
        if metas is not None and sizes is not None and len(sizes) != len(metas):
            metas = None
        saved: dict[int, torch.UntypedStorage] = {}
        if metas is None:  # the op runs now: keep the old content where the core may copy
            sizes_of, constant = runtime.graph.nbytes, runtime.graph.constant
            for handle in written:
                storage = runtime.storage_of(handle)
                if sizes_of[storage] > 0 and (constant[storage] or not runtime.overwrites(handle)):
                    saved[handle] = backend.copy_of(backend.homes.get(storage))
        random = aten.draws(schema, args, kwargs)  # NOTE [no dropout draws nothing]
        source = aten.source_of(args, kwargs) if random else None
        default = source if isinstance(source, torch.device) else None
        drawn = bool(explicit) or default is not None

        def states() -> tuple[RngState | None, tuple[tuple[int, torch.device, torch.Tensor], ...]]:
            """The generator states the recipe keeps, taken just before the op runs (NOTE [room first])."""
            rng = aten.capture((default,)) if default is not None else None
            taken = tuple((i, x.device, x.get_state()) for i, x in explicit)  # counted: ``Op.state``
            for (_, _, state), (_, x) in zip(taken, explicit, strict=True):  # the first: for an undo
                self.generators.setdefault(id(x), (x, state))
            return rng, taken

        scratch = op_scratch.known(key)
        learn = key if scratch is None and self.on_cpu else None  # now, or when our account ends
        self.unmeasured += scratch is None and not (learn is not None and _allocator.available())
        hidden = drawn or schema.hidden_writes
        extra = recompute_bytes(func, args, default, self.device, self.managed) if hidden else 0
        tensors_info = self.tensors
        if metas is None:
            backend.ahead(func, args, kwargs, schema.fresh_returns, key, saved)
            rng, generators = states()
            out, seconds = op_scratch.timed(lambda: func(*args, **kwargs), learn)
            fresh, positions_out = self._fresh(schema, out)
            made = tuple(tensors_info[h].nbytes for h in fresh)
            if len(fresh) == sum(v is not None for _, v in result_leaves(schema.fresh_returns, out)):
                backend.learned(func, key, schema.fresh_returns, out, made, args)
            self.unsized = max(self.unsized, (sum(made) + (op_scratch.known(key) or 0), schema.name))
        else:  # the backend runs it once the core has placed the outputs
            rng, generators, out, seconds = None, (), None, 0.0
            nbytes = sizes or tuple(m.untyped_storage().nbytes() for m in metas)
            fresh = [self.new_handle(m, n) for m, n in zip(metas, nbytes, strict=True)]
        op = Op(
            self.ops,
            schema.name,
            inputs,
            tuple(fresh),
            tuple(written),
            cost=seconds,
            random=random,
            scratch=aligned(scratch or 0) + extra,
            state=state_bytes(default, tuple(x for _, x in explicit), self.device) if drawn else 0,
        )
        if self.estimated:  # NOTE [same decisions]: a cost free of timing noise
            op = replace(op, cost=op_cost(op, tensors_info))
        pending = Pending(fresh, written, saved)
        pending.learn = learn
        pending.recipe = Recipe(
            func,
            schema.fresh_returns,
            tuple(leaves),
            spec,
            tuple(slots),
            tuple(positions_out),
            rng,
            torch.is_grad_enabled(),
            generators,
        )
        if metas is not None:
            pending.run = partial(backend.first_run, func, args, kwargs, pending=pending, bind=self.bind)
            pending.measure = not self.estimated
            pending.metas = metas
            pending.states = states if drawn else None
        backend.pending = pending
        runtime.call(op, [tensors_info[h] for h in fresh], prepared=True)
        if metas is not None:
            out, seconds = pending.out, pending.seconds
            pending.out = pending.run = None
        self.base_seconds += seconds
        self.events.append(runtime.graph.records[-1].op)
        self.ops += 1
        if self.released or self.wanting:
            self.flush()
        real = backend.homes.real_bytes
        if real > self.peak_real_bytes:
            self.peak_real_bytes = real
        return out

    def _outputs_here(self, named: list[torch.device], reads_here: bool) -> bool:
        """Whether the op's results are on the region's device, as its device argument (``named``),
        else its tensors or the default device tell (meta results do not)."""
        devices = named or ([] if reads_here else [torch.get_default_device()])
        return all(_same_device(d, self.device) for d in devices)

    def _note_hidden(self, schema: OpFacts, args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
        """Copy the content at entry of each tensor from before the region that this op writes
        without its schema saying so (batch norm's running statistics), before its first such write:
        an undo writes it back (NOTE [hidden writes] in ``remat.aten.schema``; declared writes keep
        their versions in the core). The copy is a constant of the region, in its budget, and an
        input of the op (so that the simulator, NOTE [first sight], meets it there too)."""
        copies = []
        for t in aten.written_tensors(schema.all_writes(args)[len(schema.writes) :], args, kwargs):
            key = t.untyped_storage()._cdata
            handle = self.handles.get(key)
            if (
                key not in self.hidden
                and handle in self.entry
                and self.entry[handle] == self.runtime.storage_of(handle)
            ):
                self.hidden[key] = (t, copy := t.detach().clone())
                copies.append(self.constant(copy, outside=False))
        return copies

    def _written(self, schema: OpFacts, args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
        written = aten.written_tensors(schema.writes, args, kwargs)
        return list(dict.fromkeys([self.handle(t) for t in written if self.managed(t)]))

    def _fresh(self, schema: OpFacts, out: Any) -> tuple[list[int], list[int]]:
        """Handles of the op's new storages, and their positions among :func:`result_leaves`."""
        fresh, positions = list[int](), list[int]()
        outside = aten.READ_OUTSIDE_OPS.get(schema.packet, -1)  # not the pool's: a constant once read
        for index, (r, t) in enumerate(result_leaves(schema.fresh_returns, out)):
            is_fresh = schema.fresh_returns[r] if r < len(schema.fresh_returns) else True
            managed = isinstance(t, torch.Tensor) and self.managed(t)  # a sparse result has no storage
            if managed and is_fresh and index != outside and t.untyped_storage()._cdata not in self.handles:
                fresh.append(handle := self.new_handle(t, t.untyped_storage().nbytes()))
                self.bind(handle, t)
                positions.append(index)
        return fresh, positions

    # -- the region's end -----------------------------------------------------------------------

    def finish(self) -> None:
        """Hand every storage the program still holds back to it, restored (NOTE [hand-over])."""
        self.flush()
        telemetry, backend = self.runtime.telemetry, self.backend
        self.marks = (telemetry.evictions, telemetry.recomputations)
        self.recompute_marks = (backend.recompute_seconds, backend.meter.recompute_cost)
        self.peak_in_program = telemetry.peak_bytes
        runtime, homes = self.runtime, self.backend.homes
        self.current = ""
        backend.meter.allowance()  # the hand-over gets a thrash allowance of its own
        runtime.finish()
        stored, pinned = homes.storage_of_handle, homes.pinned
        held = sorted(h for h in homes.program if h not in pinned and stored(h) is not None)
        self.backend.handing_over(held)
        for handle in held:  # not events of the trace: the simulator hands over in its finish
            self.backend.hand_over(runtime.storage_of(handle))
            del homes.program[handle]
            runtime.release(handle)
        self.flush()
        self.peak_real_bytes = max(self.peak_real_bytes, backend.homes.peak_real_bytes)

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.backend.close()
        self.backend.homes.clear()
        self.backend.recipes.clear()
        # The runtime and its backend refer to each other, ``explain`` to this engine: without them the
        # region's state is freed as the region ends, not left to the cycle collector's next pass.
        self.backend.runtime = None
        self.explain = _plain

    def trace(self, name: str = "dynamic") -> Trace:
        """What ran, as the simulator reads it (NOTE [same decisions])."""
        return Trace(tuple(self.tensors), tuple(self.events), frozenset(), name, self.device.type, "dynamic")


def _plain(failure: BaseException) -> Exception:  # an engine's ``explain`` until its region sets one
    return RuntimeError(str(failure))


def _same_device(a: torch.device | str, b: torch.device) -> bool:
    a = torch.device(a)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
