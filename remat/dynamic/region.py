"""``remat.dynamic``: run ordinary eager code under a hard memory budget, evicting and recomputing.

``with remat.dynamic(budget="6GB", policy="coop"): ...`` manages every tensor the block makes: when
an allocation would pass the budget the policy evicts, and an evicted tensor is recomputed from its
recorded op when something reads it (DTR, MegEngine's DTE, OneFlow's Coop). Unlike a plan, nothing
is traced ahead: shapes and control flow may change from step to step.

The budget counts everything the ops of the block touch, the constants included: parameters,
buffers, optimizer state, inputs and whatever the program holds from before the block. They stay
resident. Tensors the block makes and the program still holds at its end are restored then and are
ordinary tensors afterwards.

The object is reusable: enter it once per step; ``stats`` describes the last completed block.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterable, Mapping
from types import TracebackType

import torch
from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat._units import format_bytes, parse_bytes
from remat.core.policies.base import EvictionPolicy
from remat.core.policies.registry import resolve
from remat.core.pool import AddressPool, BytePool, Fit, Pool
from remat.core.runtime import OutOfMemory
from remat.dynamic.accounting import Backend, Thrashing
from remat.dynamic.engine import _DEPTH, Engine, Interceptor
from remat.dynamic.stats import DynamicStats, Recorder

_API = "dynamic"
BACKENDS = ("accounting", "arena")
_UNLIMITED = 2**62
_open: list[Dynamic] = []


class Dynamic:
    """A dynamic rematerialization region; see :func:`dynamic`."""

    def __init__(
        self,
        budget: int | str | None,
        policy: str | EvictionPolicy,
        backend: str,
        keep: object,
        layout: bool,
        fit: str,
        thrash_limit: float,
        cost: str,
        device: torch.device,
    ) -> None:
        self.budget = _UNLIMITED if budget is None else parse_bytes(budget, _API)
        self.policy = _policy(policy, layout)
        if backend not in BACKENDS:
            raise RematValueError(
                message(
                    _API, "unknown memory backend", f"got {backend!r}", f"use one of {', '.join(BACKENDS)}"
                )
            )
        if backend == "arena" and budget is None:
            raise RematValueError(
                message(_API, "the arena backend needs a budget", "got budget=None", 'pass e.g. budget="2GB"')
            )
        if backend == "arena" and not layout:
            raise RematValueError(
                message(
                    _API,
                    "the arena backend places tensors at addresses",
                    "got layout=False",
                    "pass layout=True",
                )
            )
        if not isinstance(fit, str) or fit not in {f.value for f in Fit}:
            raise RematValueError(message(_API, "unknown fit", f"got {fit!r}", "use 'best' or 'first'"))
        if (
            isinstance(thrash_limit, bool)
            or not isinstance(thrash_limit, int | float)
            or not thrash_limit > 1.0
        ):
            raise RematValueError(
                message(
                    _API,
                    "thrash_limit is an overhead and must be above 1",
                    f"got {thrash_limit!r}",
                    "pass e.g. 3.0",
                )
            )
        if cost not in ("measured", "model"):
            raise RematValueError(message(_API, "unknown cost", f"got {cost!r}", "use 'measured' or 'model'"))
        self.cost = cost
        self.backend = backend
        _tensors(keep)  # refuse what it cannot hold now; the tensors are listed at each entry
        self.keep = keep
        self.layout = layout
        self.fit = Fit(fit)
        self.thrash_limit = float(thrash_limit)
        self.device = device
        self._stats: DynamicStats | None = None
        self._engine: Engine | None = None
        self._mode: Interceptor | None = None
        self._recorder: Recorder | None = None
        self._depth = sys.getrecursionlimit()
        self._collecting = True

    @property
    def stats(self) -> DynamicStats:
        """Figures of the last block that completed."""
        if self._stats is None:
            raise RematValueError(
                message(
                    _API,
                    "no region has completed yet",
                    "stats read too early",
                    "read it after the with block",
                )
            )
        return self._stats

    def __enter__(self) -> Dynamic:
        if _open:
            raise RematValueError(
                message(_API, "dynamic regions do not nest", "a region is already open", "close it first")
            )
        pool: Pool = AddressPool(self.budget, self.fit) if self.layout else BytePool(self.budget)
        self._recorder = Recorder(self.policy)
        backend = self._make_backend(pool)
        engine = Engine(pool, self._recorder, backend, self.device, self.cost == "model")
        engine.explain = lambda failure: _explain(failure, engine, self)
        kept = 0
        try:
            for t in _tensors(self.keep):
                if t.device == self.device and t.untyped_storage()._cdata not in engine.handles:
                    kept += t.untyped_storage().nbytes()
                    engine.constant(t)
        except OutOfMemory:
            engine.close()
            raise RematValueError(
                message(
                    _API,
                    "the budget cannot even hold the tensors given in keep",
                    f"budget {format_bytes(self.budget)}, keep holds {format_bytes(kept)} so far",
                    "raise the budget",
                )
            ) from None
        self._engine = engine
        self._mode = Interceptor(engine)
        sys.setrecursionlimit(max(self._depth, _DEPTH))
        self._collecting = gc.isenabled()
        gc.disable()  # NOTE [releases] in ``engine``
        _open.append(self)
        self._mode.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        engine, mode = self._engine, self._mode
        assert engine is not None and mode is not None
        mode.__exit__(None, None, None)
        _open.remove(self)
        try:
            if error is None:
                try:
                    engine.finish()
                except (OutOfMemory, Thrashing) as failure:
                    engine.abandon()
                    raise _explain(failure, engine, self) from None
                self._stats = self._make_stats(engine)
            else:
                engine.abandon()
        finally:
            engine.close()
            self._engine = self._mode = None
            sys.setrecursionlimit(self._depth)
            if self._collecting:
                gc.enable()

    def _make_backend(self, pool: Pool) -> Backend:
        if self.backend == "arena":
            from remat.dynamic.arena import ArenaBackend

            assert isinstance(pool, AddressPool)
            return ArenaBackend(self.device, self.thrash_limit, pool)
        return Backend(self.device, self.thrash_limit)

    def _make_stats(self, engine: Engine) -> DynamicStats:
        runtime, backend = engine.runtime, engine.backend
        telemetry = runtime.telemetry
        assert self._recorder is not None
        return DynamicStats(
            policy=self.policy.name,
            backend=self.backend,
            layout=self.layout,
            budget=self.budget,
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
            evicted=tuple(self._recorder.victims[: engine.marks[0]]),
            exit_recomputations=telemetry.recomputations - engine.marks[1],
            trace=engine.trace(),
            policy_object=self.policy,
        )


def dynamic(
    budget: int | str | None,
    policy: str | EvictionPolicy = "dtr",
    *,
    backend: str = "accounting",
    keep: object = (),
    layout: bool = True,
    fit: str = "best",
    thrash_limit: float = 3.0,
    cost: str = "measured",
    device: torch.device | str = "cpu",
) -> Dynamic:
    """A region that keeps the memory of the ops it runs within ``budget`` by evicting and
    recomputing.

    ``budget``: bytes (an int or a size such as ``"6GB"``; ``None``: unlimited, to measure the
    runtime itself). ``policy``: a registered eviction policy (``remat.core.policies.names()``:
    ``"dtr"``, ``"dte"``, ``"coop"`` ...) or a policy object. ``backend``: ``"accounting"`` (tensors
    stay in PyTorch's allocator, the core's pool keeps the accounts) or ``"arena"`` (one buffer of
    ``budget`` bytes allocated up front, outputs placed at the addresses the pool chooses).
    ``keep``: modules, optimizers and tensors to register as constants before the first op, in that
    order (they would become constants anyway when first read; registering them first fixes the
    pool's layout, as in the simulator, which registers every constant first). ``layout``: model
    addresses (needed by Coop) or count bytes. ``fit``: ``"best"`` or ``"first"``.
    ``thrash_limit``: stop with an error once recomputation costs more than ``thrash_limit - 1``
    times the first runs so far. ``cost``: what an op costs for the policy, ``"measured"`` (its
    time, as DTR) or ``"model"`` (the estimate of :mod:`remat.trace.cost`: no timing noise, so the
    same step makes the same decisions every time).
    """
    dev = torch.device(device)
    return Dynamic(budget, policy, backend, keep, layout, fit, thrash_limit, cost, dev)


def _policy(policy: object, layout: bool) -> EvictionPolicy:
    return resolve(policy, layout, _API)


def _tensors(keep: object) -> list[torch.Tensor]:
    """Every tensor of ``keep``: modules (parameters, buffers), optimizers (state), tensors and
    (nested) sequences or mappings of them."""
    found: list[torch.Tensor] = []

    def visit(item: object) -> None:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, nn.Module):
            found.extend(item.parameters())
            found.extend(item.buffers())
        elif isinstance(item, torch.optim.Optimizer):
            for state in item.state.values():
                visit(list(state.values()))
        elif isinstance(item, Mapping):
            for value in item.values():
                visit(value)
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            for value in item:
                visit(value)
        elif item is not None and not isinstance(item, (int, float, bool)):
            raise RematTypeError(
                message(
                    _API,
                    "keep takes modules, optimizers, tensors and collections of them",
                    f"got {type(item).__name__}",
                    "pass e.g. keep=(model, optimizer)",
                )
            )

    visit(keep)
    return found


def _explain(failure: BaseException, engine: Engine, region: Dynamic) -> Exception:
    budget = format_bytes(region.budget)
    if isinstance(failure, Thrashing):
        backend = engine.backend
        return RematValueError(
            message(
                _API,
                f"the budget makes policy {region.policy.name!r} thrash: recomputation passed "
                f"thrash_limit={region.thrash_limit}",
                f"budget {budget}; {backend.recomputed_ops} recomputations costing "
                f"{backend.recompute_cost * 1e3:.1f} ms for {backend.base_cost * 1e3:.1f} ms of first runs, "
                f"stopped at op {engine.ops} ({engine.current})",
                "raise the budget, or thrash_limit if this overhead is acceptable",
            )
        )
    assert isinstance(failure, OutOfMemory)
    op = f"op {engine.ops} ({engine.current})" if engine.current else "the end of the region"
    if failure.needed > region.budget:
        return RematValueError(
            message(
                _API,
                f"the budget cannot hold what {op} needs at once: it needs at least "
                f"{failure.needed} bytes = {format_bytes(failure.needed)}",
                f"budget {region.budget} bytes ({budget})",
                f"pass a budget of at least {failure.needed} bytes",
            )
        )
    other = "" if region.policy.name.startswith("coop") else ", use policy 'coop'"
    return RematValueError(
        message(
            _API,
            f"{op} found no contiguous room: the free memory is split by pinned pieces",
            f"budget {budget}, {failure}",
            f"raise the budget{other} or pass layout=False",
        )
    )
