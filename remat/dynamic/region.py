"""``remat.dynamic``: run ordinary eager code under a hard memory budget, evicting and recomputing.

``with remat.dynamic(budget="6GB", policy="coop"): ...`` manages every tensor the block makes: when an
allocation would pass the budget the policy evicts, and an evicted tensor is recomputed from its recorded
op when something reads it (DTR, MegEngine's DTE, OneFlow's Coop). Unlike a plan, nothing is traced ahead:
shapes and control flow may change from step to step.

The budget counts everything the ops of the block touch, the constants included: parameters, buffers,
optimizer state, inputs and whatever the program holds from before the block. They stay resident. Tensors
the block makes and the program still holds at its end are restored then and are ordinary tensors
afterwards.

The budget holds in the allocator's count, not only in the pool's (NOTE [room first] in ``engine``). What
the runtime cannot count ahead is covered by the ``reserve``, a part of the budget set aside at
construction: the pool gets the rest. It covers kernels' scratch where it is unknown (NOTE [recompute
bytes] in ``op_bytes``: a warning says so), the results of ops run before they are placed, and on the
arena all scratch and copies (NOTE [beside the arena] in ``arena``).

A region that fails (out of room, thrashing, or an error in the program) undoes the step
(:mod:`remat.dynamic.undo`) and says so in the error. The object is reusable: enter it once per step;
``stats`` describes the last completed block."""

from __future__ import annotations

import dataclasses
import gc
import math
import numbers
import sys
from types import TracebackType

import torch

from remat._arguments import device_of
from remat._errors import RematError, RematRuntimeError, RematTypeError, RematValueError, message
from remat._units import format_bytes, parse_budget, parse_bytes
from remat.core.driver import Thrashed, deepen, make_pool
from remat.core.policies.base import EvictionPolicy
from remat.core.policies.registry import resolve
from remat.core.pool import Fit, OutOfMemory, Pool
from remat.core.swap import Swap
from remat.dynamic import backends, homes
from remat.dynamic.accounting import AccountingBackend
from remat.dynamic.engine import Engine
from remat.dynamic.failures import explain
from remat.dynamic.interceptor import Interceptor
from remat.dynamic.keep import API, arrived, members
from remat.dynamic.op_bytes import warn_unmeasured, warn_unsized
from remat.dynamic.stats import UNLIMITED, DynamicStats, Recorder
from remat.dynamic.undo import Snapshot, abandon, rewind, take, watch_steps, write_back
from remat.dynamic.wanted import watch
from remat.host.link import Link

_open: list[Dynamic] = []


class Dynamic:
    """A dynamic rematerialization region; see :func:`dynamic`."""

    def __init__(
        self,
        budget: int | float | str | None,
        policy: str | EvictionPolicy,
        backend: str,
        keep: object,
        layout: bool,
        fit: str,
        thrash_limit: float,
        cost: str,
        device: torch.device,
        reserve: int | float | str,
        peak: int | str | None = None,
        swap: Link | None = None,
    ) -> None:
        self.swap = _swap(swap, backends.get(backend, API).places, backend)
        amount = None if budget is None else parse_budget(budget, API)
        # NOTE [ratio budgets] A ratio is of the plain step's peak: given (``peak``), or measured by
        # the first block, which runs with no budget (the pool's peak: what the block held, the
        # undo snapshot's copies included); later blocks run within the ratio of it, the reserve
        # taken from that budget as from any other (so 1.0 may still evict).
        self.ratio = amount if isinstance(amount, float) else None
        if peak is not None and self.ratio is not None:
            amount = max(1, int(self.ratio * parse_bytes(peak, API)))
        elif peak is not None:
            given = f"got budget={budget!r}, peak={peak!r}"
            raise RematValueError(message(API, "peak is for a ratio budget", given, "drop peak"))
        self.budget = amount if isinstance(amount, int) else UNLIMITED
        checked = _reserve(reserve, self.budget)  # its form checked whatever the budget (a ratio's: later)
        self.reserve = 0 if self.budget == UNLIMITED else checked
        self._reserve_spec = reserve
        if not isinstance(layout, bool):
            hint = "pass layout=True (a pool with addresses) or False (bytes only)"
            raise RematTypeError(message(API, "layout must be True or False", f"got {layout!r}", hint))
        self.policy: EvictionPolicy = resolve(policy, layout, API)
        kind = backends.get(backend, API)
        if kind.places and self.budget == UNLIMITED:
            rule = f"the {backend} backend needs a budget in bytes before its first block"
            given = f"got budget={budget!r}" + (" with no peak" if self.ratio is not None else "")
            hint = 'pass e.g. budget="2GB", or a ratio with peak= the plain step\'s peak'
            raise RematValueError(message(API, rule, given, hint))
        if kind.places and not layout:
            rule = f"the {backend} backend places tensors at addresses"
            raise RematValueError(message(API, rule, "got layout=False", "pass layout=True"))
        if not isinstance(fit, str) or fit not in {f.value for f in Fit}:
            raise RematValueError(message(API, "unknown fit", f"got {fit!r}", "use 'best' or 'first'"))
        number = isinstance(thrash_limit, numbers.Real) and not isinstance(thrash_limit, bool)
        if not (number and 1.0 < thrash_limit < math.inf):
            rule = "thrash_limit is an overhead and must be a finite number above 1"
            raise RematValueError(message(API, rule, f"got {thrash_limit!r}", "pass e.g. 3.0"))
        if cost not in ("measured", "model"):
            raise RematValueError(message(API, "unknown cost", f"got {cost!r}", "use 'measured' or 'model'"))
        self.cost = cost
        self.backend = backend
        members(keep)  # refuse what it cannot hold now; the members are listed at each entry
        self.keep = keep
        self.layout = layout
        self.fit = Fit(fit)
        self.thrash_limit = float(thrash_limit)
        self.device = device
        self._stats: DynamicStats | None = None
        self._engine: Engine | None = None
        self._mode: Interceptor | None = None
        self._recorder: Recorder | None = None
        self._depth, self._collecting = sys.getrecursionlimit(), True
        self._snapshot: Snapshot | None = None
        self.arriving = 0  # NOTE [arriving constants] in ``keep``: of the last completed block
        self.left_open = False  # a DynamicModule's: open past the call, until a region after it

    @property
    def stats(self) -> DynamicStats:
        """Figures of the last block that completed."""
        if self._stats is None:
            rule = "no region has completed yet"
            raise RematValueError(message(API, rule, "stats read too early", "read it after the with block"))
        return self._stats

    def __enter__(self) -> Dynamic:
        if _open and _open[-1].failed and _open[-1].left_open:  # a DynamicModule's, given up on
            _open[-1].__exit__(None, None, None)  # after its failure: its step is undone already
        if _open:
            raise RematValueError(
                message(API, "dynamic regions do not nest", "a region is already open", "close it first")
            )
        capacity = self.capacity
        pool = make_pool(capacity, self.layout, self.fit)
        self._recorder = Recorder(self.policy)
        backend = self._make_backend(pool)
        self._recorder.moments = backend.moments
        engine = Engine(pool, self._recorder, backend, self.device, self.cost == "model")
        if self.swap is not None:
            engine.runtime.swap = Swap(self.swap, backend)
        engine.explain = lambda failure: self._fail(engine, explain(failure, engine, self))
        kept = 0
        listed = members(self.keep)
        try:
            for t in (m for m in listed if isinstance(m, torch.Tensor)):
                if t.device == self.device and t.untyped_storage()._cdata not in engine.handles:
                    kept += t.untyped_storage().nbytes()
                    engine.constant(t)
            self._entered = len(engine.tensors)  # NOTE [arriving constants] in ``keep``: later arrive
            self._snapshot = take(listed)
            if self.device.type == "cpu":  # the generator state the snapshot keeps is in the budget
                for state in self._snapshot.rng.tensors():
                    engine.constant(state, outside=False)
            for buffer, content in self._snapshot.buffers:  # and so are the buffers' copies
                engine.hidden[buffer.untyped_storage()._cdata] = (buffer, content)  # not copied again
                if content.device == self.device:
                    engine.constant(content, outside=False)
        except OutOfMemory:
            engine.close()
            raise RematValueError(
                message(
                    API,
                    "the budget cannot even hold the tensors given in keep and the step's snapshot",
                    f"budget {format_bytes(self.budget)} less the reserve {format_bytes(self.reserve)}, "
                    f"keep holds {format_bytes(kept)}, the snapshot copies generators and buffers",
                    "raise the budget",
                )
            ) from None
        backend.open()
        engine.hooks += watch(listed, engine.wanted, engine.watched)  # those not read yet too
        engine.hooks.append(watch_steps(self._snapshot))
        self._engine = engine
        self._mode = Interceptor(engine)
        self._depth = deepen()
        self._collecting = gc.isenabled()
        gc.disable()  # NOTE [releases] in ``engine``
        _open.append(self)
        self._mode.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        engine, mode = self._engine, self._mode
        if engine is None or mode is None:
            hint = "use the region as `with remat.dynamic(...):`"
            raise RematRuntimeError(
                message(API, "the region was left without being entered", "__exit__", hint)
            )
        mode.__exit__(None, None, None)
        _open.remove(self)
        try:
            if engine.failed:  # undone when it failed; whatever ran after it ran as plain PyTorch
                pass
            elif error is None:
                try:
                    engine.finish()
                except BaseException as failure:  # Ctrl-C or a kernel's error in the hand-over: undone too
                    ours = isinstance(failure, (OutOfMemory, Thrashed)) and not isinstance(
                        failure, RematError
                    )
                    explained = explain(failure, engine, self) if ours else failure
                    self._undo(engine, explained)
                    if not ours:
                        raise
                    raise explained from None
                self._stats = self._make_stats(engine)
                if self.budget != UNLIMITED:
                    warn_unsized(engine.unsized, self.reserve)
                self.arriving = self._stats.arrived_bytes  # NOTE [arriving constants] in ``keep``
                if self.ratio is not None and self.budget == UNLIMITED:  # NOTE [ratio budgets]
                    budget = max(1, int(self.ratio * self._stats.peak_bytes))
                    self.reserve = _reserve(self._reserve_spec, budget)
                    self.budget = budget
                warn_unmeasured(self._stats.unmeasured_scratch, self.device)
            else:
                self._undo(engine, error)
        finally:  # the process's settings first: an interrupt in ``close`` must not keep them
            sys.setrecursionlimit(self._depth)
            if self._collecting:
                gc.enable()
            engine.close()
            self._engine = self._mode = None

    @property
    def failed(self) -> bool:  # open after its failure, running the rest of the step as is
        return self._engine is not None and self._engine.failed

    @property
    def capacity(self) -> int:
        """The budget less the reserve and ``arriving``, rounded down (NOTE [alignment] in ``homes``)."""
        free = self.budget - self.reserve - self.arriving
        return max(1, free - free % homes.ALIGNMENT)

    def least_budget(self, needed: int) -> int:
        """The smallest budget whose pool holds ``needed`` bytes with this region's reserve."""
        needed += self.arriving + homes.ALIGNMENT - 1  # the capacity is rounded down
        spec = self._reserve_spec
        return math.ceil(needed / (1.0 - spec)) + 1 if isinstance(spec, float) else needed + self.reserve

    def _fail(self, engine: Engine, error: Exception) -> Exception:
        """An op of the region cannot run within the budget: undo the step at once, wherever the
        error is caught (in a ``DynamicModule`` the region stays open past the forward), and let
        every later op of the region run as plain PyTorch."""
        self._undo(engine, error)
        engine.failed = True
        if self._collecting:  # nothing of the engine's runs any more (NOTE [releases] in ``engine``)
            gc.enable()
        return error

    def _undo(self, engine: Engine, error: BaseException) -> None:
        """Put training back as it was at entry and say so in ``error`` (:mod:`undo`)."""
        restored, lost = write_back(engine)
        with torch.no_grad():  # after the versions: a hidden write changed the first in place
            for tensor, content in engine.hidden.values():
                tensor.copy_(content)
        restored += len(engine.hidden)
        abandon(engine)
        assert self._snapshot is not None
        for generator, state in engine.generators.values():  # then the defaults', as at entry
            generator.set_state(state)
        rewind(self._snapshot)
        said = (
            f"the step was undone: {restored} tensors from before the region written back to their "
            "content at entry; the state of every optimizer in keep or stepped in the region, the "
            "gradients of what keep holds and the generators as at entry"
        )
        if lost:
            said += f"; not restorable: {', '.join(lost)}"
        if isinstance(error, RematError) and error.args:
            error.args = (f"{error.args[0]}; {said}", *error.args[1:])
        else:
            error.add_note(f"remat.dynamic: {said}")

    def _make_backend(self, pool: Pool) -> AccountingBackend:
        backend: AccountingBackend = backends.get(self.backend, API).create(
            self.device, self.thrash_limit, pool, self.budget - self.capacity
        )
        return backend

    def _make_stats(self, engine: Engine) -> DynamicStats:
        runtime, backend = engine.runtime, engine.backend
        telemetry = runtime.telemetry
        assert self._recorder is not None
        return DynamicStats(
            policy=self.policy.name,
            backend=self.backend,
            layout=self.layout,
            fit=self.fit,
            budget=self.budget,
            reserve=self.reserve,
            outside_bytes=engine.outside_bytes,
            arriving=self.arriving,
            capacity=self.capacity,
            arrived_bytes=arrived(engine.tensors, engine.entry, self._entered, backend.places),
            moments=tuple(engine.moments),
            ops=engine.ops,
            evictions=engine.marks[0],
            recomputations=engine.marks[1],
            base_seconds=engine.base_seconds,
            recompute_seconds=engine.recompute_marks[0],
            recompute_cost=engine.recompute_marks[1],
            peak_bytes=engine.peak_in_program,
            peak_real_bytes=engine.peak_real_bytes,
            needed_bytes=telemetry.working_set,
            fragmentation=telemetry.fragmentation,
            search_seconds=telemetry.search_seconds,
            copied_ops=tuple(sorted(getattr(backend, "copied", ()))),
            unmeasured_scratch=engine.unmeasured,
            evicted=tuple(self._recorder.victims[: engine.marks[0]]),
            wants=tuple(runtime.wants),
            exit_recomputations=telemetry.recomputations - engine.marks[1],
            trace=engine.trace(),
            policy_object=self.policy,
            swap=None if runtime.swap is None else dataclasses.replace(runtime.swap.counts),
        )


def dynamic(
    budget: int | float | str | None,
    policy: str | EvictionPolicy = "dtr",
    *,
    backend: str = "accounting",
    keep: object = (),
    layout: bool = True,
    fit: str = "best",
    thrash_limit: float = 3.0,
    cost: str = "measured",
    device: torch.device | str = "cpu",
    reserve: int | float | str = 0.05,
    peak: int | str | None = None,
    swap: Link | None = None,
) -> Dynamic:
    """A region that keeps the memory of the ops it runs within ``budget`` by evicting and
    recomputing.

    ``budget``: bytes (an int or a size such as ``"6GB"``; ``None``: unlimited, to measure the
    runtime itself), or a ratio (a float in (0, 1], as ``remat.plan`` takes) of the plain step's
    peak: ``peak`` gives it in bytes, else the region's first block measures it, running with no
    budget (reuse the region object across steps; its ``budget`` is set once that block ends; state
    an optimizer makes in its first step is not in that peak: pass ``peak`` where it matters).
    ``policy``: a registered eviction policy (``remat.core.policies.names()``: ``"dtr"``, ``"dte"``,
    ``"coop"`` ...) or a policy object. ``backend``: ``"accounting"`` (tensors
    stay in PyTorch's allocator, the core's pool keeps the accounts) or ``"arena"`` (one buffer of
    ``budget`` bytes allocated up front, outputs placed at the addresses the pool chooses).
    ``keep``: modules, optimizers and tensors (with their gradients) to count from the start, in
    that order (others count from their first read: NOTE [arriving constants] in ``keep``).
    ``layout``: model addresses (needed by Coop) or count bytes. ``fit``: ``"best"`` or ``"first"``.
    ``thrash_limit``: stop with an error once recomputation costs more than ``thrash_limit - 1``
    times the first runs so far. ``cost``: what an op costs for the policy, ``"measured"`` (its
    time, as DTR) or ``"model"`` (the estimate of :mod:`remat.trace.cost`: no timing noise, so the
    same step makes the same decisions every time). ``reserve``: the part of the budget set aside
    for what the runtime cannot count ahead (see the module docstring), a fraction of the budget
    (a float below 1) or bytes; the pool holds the rest. ``swap``: a :class:`remat.Link`; a victim
    whose copy to host memory hides behind compute on that link goes there instead of being dropped,
    and comes back instead of being recomputed (Capuchin; :mod:`remat.core.swap`); host copies are
    out of the budget (``stats.swap`` counts them).

    The budget counts the tensors from before the region that its ops read (parameters, optimizer
    state, inputs), and the allocator's count never passes it. A region that fails undoes the step
    (:mod:`remat.dynamic.undo`).
    """
    homes.require_swap(API)
    dev = device_of(device, API)
    return Dynamic(budget, policy, backend, keep, layout, fit, thrash_limit, cost, dev, reserve, peak, swap)


def _reserve(reserve: object, budget: int) -> int:
    if isinstance(reserve, bool) or isinstance(reserve, float) and not 0.0 <= reserve < 1.0:
        amount = -1
    elif isinstance(reserve, float | numbers.Integral):
        amount = int(reserve * budget) if isinstance(reserve, float) else int(reserve)
    else:
        amount = parse_bytes(reserve, API)  # type: ignore[arg-type]
    if not 0 <= amount < budget:
        rule = "the reserve is a part of the budget: a fraction in [0, 1) or fewer bytes than the budget"
        given = f"got reserve={reserve!r} for a budget of {format_bytes(budget)}"
        raise RematValueError(message(API, rule, given, "pass e.g. reserve=0.05 or reserve='64MiB'"))
    return amount


def _swap(swap: object, places: bool, backend: str) -> Link | None:
    if swap is None or (isinstance(swap, Link) and not places):
        return swap
    if not isinstance(swap, Link):
        raise RematTypeError(message(API, "swap must be a remat.Link", f"got {swap!r}", "pass remat.Link()"))
    rule = f"the {backend} backend places tensors in its arena, where a swapped one cannot return"
    raise RematValueError(message(API, rule, f"got swap={swap!r}", 'use backend="accounting" to swap'))
