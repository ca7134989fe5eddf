"""Capture one training step as a Trace: every ATen op, the storages it reads, makes and mutates,
and the moment the program lets go of each one.

Why a dispatch mode and not a graph capture (torch.fx, torch.compile): what rematerialization
trades is memory, and memory is decided by eager PyTorch itself: which tensors autograd saves,
when its engine frees them, views, in-place ops, the optimizer's state. A TorchDispatchMode sees
every ATen op that runs, forward, backward (the engine runs inside the mode) and optimizer alike,
on real or fake tensors, and finalizers on storage objects say when memory dies.

NOTE [trace identity]
- A storage is the unit of memory. PyTorch keeps a storage's Python object alive exactly as long as
  the memory, so ``weakref.finalize`` on it fires when the memory is freed (as in
  ``remat.memory``); the capture then releases every handle of that storage.
- A TensorInfo is a handle made by an op: the first op output on a storage owns it, view outputs
  (and outputs that share an existing storage) are aliases of the owner. Storages an op reads
  without any op having made them existed before the step: constants.
- Python tensor objects are no identity: autograd keeps only the C++ tensor of a saved output and
  builds a new one when backward unpacks it. An op input is found by its TensorImpl address if
  that still has the recorded storage and geometry, else by (storage, offset, shape, stride,
  dtype), else it is taken as the storage's owner.

NOTE [phases] An op is BACKWARD while the autograd engine runs a node, OPTIMIZER inside
``Optimizer.step``, FORWARD inside a module's forward. Other ops are FORWARD before the first
backward op, BACKWARD up to the last one (gradient accumulation between nodes) and OPTIMIZER
after it (gradient clipping, zero_grad).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat import _scratch, aten
from remat._allocator import scratch_of
from remat._errors import RematTypeError, RematValueError, message
from remat.trace import cost
from remat.trace.types import Op, Phase, Release, TensorInfo, Trace

__all__ = ["capture"]

# Key under which a forward op's module path is stored on its autograd node, so that the backward
# ops the node runs are attributed to the same module.
_MODULE_KEY = "remat.trace.module"


@dataclass
class _Storage:
    owner: int
    handles: list[int] = field(default_factory=list)
    by_geometry: dict[aten.Geometry, int] = field(default_factory=dict)
    impls: list[int] = field(default_factory=list)


@dataclass
class _OpRecord:
    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    mutates: tuple[int, ...]
    cost: float
    phase: Phase | None  # None: decided at the end, see NOTE [phases]
    module: str
    random: bool
    scratch: int


class _Recorder(TorchDispatchMode):
    """Records ops and storage deaths; see NOTE [trace identity]."""

    def __init__(self, repeats: int, progress: Callable[[int], None] | None, scratch: bool = True) -> None:
        super().__init__()
        self.repeats = repeats
        self.scratch = scratch
        self.progress = progress
        self.tensors: list[TensorInfo] = []
        self.events: list[_OpRecord | Release] = []
        self.storages: dict[int, _Storage] = {}
        self.storage_key: list[int] = []
        self.impl: dict[int, int] = {}
        self.saved: set[int] = set()
        self.saved_at: list[tuple[int, int]] = []
        self.op_module: list[str] = []  # per tensor id: module path of the op that made it
        self.modules: list[str] = []
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.in_optimizer = 0
        self.finalizers: list[weakref.finalize] = []
        self.device: str | None = None
        self.fake = False
        self.n_ops = 0

    # -- tensors --------------------------------------------------------------------------------

    def _new_handle(
        self, t: torch.Tensor, key: int, nbytes: int, alias_of: int | None, constant: bool
    ) -> int:
        hid = len(self.tensors)
        self.tensors.append(
            TensorInfo(hid, nbytes, alias_of, constant, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        )
        self.storage_key.append(key)
        self.op_module.append("")
        rec = self.storages[key]
        rec.handles.append(hid)
        rec.by_geometry[aten.geometry(t)] = hid
        rec.impls.append(t._cdata)
        self.impl[t._cdata] = hid
        return hid

    def _new_storage(self, t: torch.Tensor, storage: torch.UntypedStorage, constant: bool) -> int:
        key = storage._cdata
        self.storages[key] = _Storage(owner=len(self.tensors))
        self.finalizers.append(weakref.finalize(storage, self._storage_died, key))
        if self.device is None:
            self.device = t.device.type
            self.fake = is_fake(t)
        return self._new_handle(t, key, storage.nbytes(), None, constant)

    def _storage_died(self, key: int) -> None:
        rec = self.storages.pop(key, None)
        if rec is None:
            return
        for impl in rec.impls:
            if self.impl.get(impl) in rec.handles:
                del self.impl[impl]
        self.events.extend(Release(h) for h in reversed(rec.handles))

    def handle(self, t: torch.Tensor) -> int | None:
        """The id of an existing tensor (an op input): see NOTE [trace identity]."""
        storage = aten.storage_of(t)
        if storage is None:
            return None
        key = storage._cdata
        rec = self.storages.get(key)
        if rec is None:
            return self._new_storage(t, storage, constant=True)
        geometry = aten.geometry(t)
        hid = self.impl.get(t._cdata)
        if hid is not None and self.storage_key[hid] == key and rec.by_geometry.get(geometry) == hid:
            return hid
        return rec.by_geometry.get(geometry, rec.owner)

    def _output(self, t: torch.Tensor, is_view: bool) -> int | None:
        storage = aten.storage_of(t)
        if storage is None:
            return None
        key = storage._cdata
        if key not in self.storages:
            if not is_view:
                return self._new_storage(t, storage, constant=False)
            self._new_storage(t, storage, constant=True)  # a view of a storage that existed before
        return self._new_handle(t, key, 0, self.storages[key].owner, constant=False)

    # -- ops ------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        facts = aten.facts(func)
        if facts.skipped:
            return func(*args, **kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        handles = [self.handle(t) for t in leaves]
        written = [
            (t, h)
            for t in aten.written_tensors(facts.writes, args, kwargs)
            if (h := self.handle(t)) is not None
        ]
        random = facts.random
        pure = facts.pure  # safe to run again (NOTE [hidden writes] in ``remat.aten.schema``)
        out, seconds = self._run(func, args, kwargs, leaves, repeat=pure)
        scratch = self._scratch(func, args, kwargs, leaves) if pure and seconds > 0 else 0
        for t, h in written:  # in-place view ops (t_, squeeze_, as_strided_) change the geometry
            self._rebind(t, h)
        returns = tuple(
            (not fresh and not w, w)
            for fresh, w in zip(facts.fresh_returns, facts.written_returns, strict=True)
        )
        outputs: list[int] = []
        pairs = [(returns[0], out)] if len(returns) == 1 else zip(returns, out or (), strict=False)
        for (is_view, is_write), result in pairs:
            if is_write:  # returns the mutated argument itself, recorded in ``mutates``
                continue
            for t in tree_leaves(result):
                if isinstance(t, torch.Tensor) and (made := self._output(t, is_view)) is not None:
                    outputs.append(made)
        phase, module = self._where()
        for h in outputs:
            self.op_module[h] = module
        inputs = tuple(h for h in handles if h is not None)
        mutates = tuple(dict.fromkeys(h for _, h in written))
        self.events.append(
            _OpRecord(str(func), inputs, tuple(outputs), mutates, seconds, phase, module, random, scratch)
        )
        if phase in (Phase.FORWARD, None) and torch.is_grad_enabled():
            self._tag_nodes(leaves, handles)
        self.n_ops += 1
        if self.progress is not None and self.n_ops % 256 == 0:
            self.progress(self.n_ops)
        return out

    def _rebind(self, t: torch.Tensor, hid: int) -> None:
        rec = self.storages.get(self.storage_key[hid])
        if rec is not None:
            rec.by_geometry[aten.geometry(t)] = hid
            rec.impls.append(t._cdata)
            self.impl[t._cdata] = hid

    def _run(
        self,
        func: Any,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        leaves: list[torch.Tensor],
        repeat: bool,
    ) -> tuple[Any, float]:
        cuda = any(t.is_cuda for t in leaves)
        times = []
        out = None
        # The first call is the program's own; repeats (pure ATen ops only: no mutation, no RNG
        # draw, no collective) run on the same inputs and their results are dropped at once.
        for i in range(self.repeats if repeat else 1):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = func(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            if i == 0:
                out = result
                if any(
                    isinstance(t, torch.Tensor) and (is_fake(t) or t.is_meta)
                    for t in (*leaves, *tree_leaves(out))
                ):
                    return out, 0.0  # nothing ran: fake and meta tensors have no time
            del result
        return out, statistics.median(times)

    def _scratch(
        self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], leaves: list[torch.Tensor]
    ) -> int:
        """The bytes the op's kernel allocates and frees while it runs (``Op.scratch``), measured on
        one more run of the op (pure ops only) under the allocator's account
        (``remat._allocator``), once per signature: the op, its tensors' geometry and its other
        arguments."""
        if not self.scratch or not leaves:
            return 0
        key = _scratch.signature(func, args, kwargs)
        known = _scratch.known(key)
        if known is None:
            measured = scratch_of(lambda: func(*args, **kwargs), leaves[0].device)
            if measured is None:
                return 0
            known = _scratch.learn(key, measured)
        return known

    def _where(self) -> tuple[Phase | None, str]:
        if self.in_optimizer:
            return Phase.OPTIMIZER, self.modules[-1] if self.modules else ""
        node = torch._C._current_autograd_node()
        if node is not None:
            return Phase.BACKWARD, str(_metadata(node).get(_MODULE_KEY, ""))
        if self.modules:
            return Phase.FORWARD, self.modules[-1]
        return None, ""

    def _tag_nodes(self, leaves: list[torch.Tensor], handles: list[int | None]) -> None:
        # An op's outputs get their grad_fn only after the op returns, so each op tags the nodes of
        # its inputs with the module of the op that made them.
        for t, h in zip(leaves, handles, strict=True):
            node = t.grad_fn
            if node is not None and h is not None:
                _metadata(node).setdefault(_MODULE_KEY, self.op_module[h])

    # -- modules, optimizer, saved tensors ------------------------------------------------------

    def module_pre(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(module)
        if name is None:
            if self.modules:
                name = f"{self.modules[-1]}.{type(module).__name__}"
            else:
                self.name_modules(module)
                name = self.names[module]
        self.modules.append(name)

    def module_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.modules:
            self.modules.pop()

    def name_modules(self, root: nn.Module) -> None:
        for qualified, m in root.named_modules():
            self.names.setdefault(m, qualified or type(root).__name__)

    def optimizer_pre(self, *args: Any) -> None:
        self.in_optimizer += 1

    def optimizer_post(self, *args: Any) -> None:
        self.in_optimizer -= 1

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        h = self.handle(t)
        if h is not None:
            self.saved.add(h)
            self.saved_at.append((h, self.n_ops))
        return t

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        handles = [
            nn.modules.module.register_module_forward_pre_hook(self.module_pre),
            nn.modules.module.register_module_forward_hook(self.module_post, always_call=True),
            register_optimizer_step_pre_hook(self.optimizer_pre),
            register_optimizer_step_post_hook(self.optimizer_post),
        ]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t), self:
                yield
        finally:
            for h in handles:
                h.remove()
            for fin in self.finalizers:
                fin.detach()

    def trace(self, name: str) -> Trace:
        backward = [i for i, r in enumerate(self._ops()) if r.phase is Phase.BACKWARD]
        first, last = (backward[0], backward[-1]) if backward else (len(self.events), len(self.events))
        events: list[Op | Release] = []
        index = 0
        for e in self.events:
            if isinstance(e, Release):
                events.append(e)
                continue
            phase = e.phase
            if phase is None:
                phase = (
                    Phase.FORWARD if index < first else Phase.BACKWARD if index < last else Phase.OPTIMIZER
                )
            events.append(
                Op(
                    index,
                    e.name,
                    e.inputs,
                    e.outputs,
                    e.mutates,
                    e.cost,
                    0.0,
                    phase,
                    e.module,
                    e.random,
                    e.scratch,
                )
            )
            index += 1
        source = "capture-fake" if self.fake else "capture"
        return Trace(
            tuple(self.tensors),
            tuple(events),
            frozenset(self.saved),
            name,
            self.device or "cpu",
            source,
            tuple(self.saved_at),
        )

    def _ops(self) -> list[_OpRecord]:
        return [e for e in self.events if isinstance(e, _OpRecord)]


def _metadata(node: Any) -> dict[str, Any]:
    # Node.metadata is a dict property at run time, typed as a method in torch's stubs.
    return cast(dict[str, Any], node.metadata)


@overload
def capture(
    step: Callable[[], object],
    *,
    name: str = ...,
    repeats: int = ...,
    device: cost.DeviceProfile | str | None = ...,
    progress: Callable[[int], None] | None = ...,
    scratch: bool = ...,
) -> Trace: ...


@overload
def capture(
    step: nn.Module,
    inputs: torch.Tensor | Sequence[Any] | Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = ...,
    name: str = ...,
    repeats: int = ...,
    device: cost.DeviceProfile | str | None = ...,
    progress: Callable[[int], None] | None = ...,
    scratch: bool = ...,
) -> Trace: ...


def capture(
    step: Callable[[], object] | nn.Module,
    inputs: torch.Tensor | Sequence[Any] | Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    name: str = "",
    repeats: int = 3,
    device: cost.DeviceProfile | str | None = None,
    progress: Callable[[int], None] | None = None,
    scratch: bool = True,
) -> Trace:
    """Run one training step and return its Trace.

    ``capture(step)`` runs ``step()`` (forward, backward and, if it does one, the optimizer step).
    ``capture(model, inputs, loss_fn, optimizer=None)`` runs ``loss_fn(model(*inputs)).backward()``
    (``model(**inputs)`` for a mapping) after setting the model's gradients to None, then
    ``optimizer.step()`` if one is given. A model whose parameters are fake tensors runs under
    their FakeTensorMode; a ``step`` on fake tensors must enter its mode itself.

    Each op's ``cost`` is the median of ``repeats`` timed runs (ops that mutate, draw random
    numbers or are not ATen ops run once; 0.0 on fake tensors); ``est_cost`` comes from
    ``remat.trace.cost`` for ``device`` (a profile or preset name; default by the trace's
    device). ``progress(n)`` is called every 256 ops. With ``scratch`` (the default), each pure
    op's ``scratch`` (the buffers its kernel allocates and frees while it runs) is measured on one
    more run of the op, once per op signature and process; on CPU through the profiler, so not
    while another profiler runs (it is then 0).
    """
    if repeats < 1:
        raise RematValueError(
            message("trace.capture", "repeats must be a positive integer", f"got {repeats}", "pass 1 or more")
        )
    if isinstance(step, nn.Module):
        if inputs is None or loss_fn is None:
            raise RematTypeError(
                message(
                    "trace.capture",
                    "a model needs inputs and a loss function",
                    f"got inputs={type(inputs).__name__}, loss_fn={type(loss_fn).__name__}",
                    "call capture(model, inputs, loss_fn) or capture(step) with a callable",
                )
            )
        run, fake_mode = _model_step(step, inputs, loss_fn, optimizer)
        name = name or type(step).__name__
    elif callable(step):
        run, fake_mode = step, None
    else:
        raise RematTypeError(
            message(
                "trace.capture",
                "the step must be a callable or an nn.Module",
                f"got {type(step).__name__}",
                "pass a function that runs one training step",
            )
        )
    recorder = _Recorder(repeats, progress, scratch)
    if isinstance(step, nn.Module):
        recorder.name_modules(step)
    with fake_mode if fake_mode is not None else contextlib.nullcontext(), recorder.hooks():
        run()
    return cost.estimate(recorder.trace(name), device)


def _model_step(
    model: nn.Module,
    inputs: torch.Tensor | Sequence[Any] | Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
) -> tuple[Callable[[], object], Any]:
    from torch._guards import detect_fake_mode

    leaves = [*model.parameters(), *model.buffers(), *tree_leaves(inputs)]
    fake_mode = detect_fake_mode([t for t in leaves if isinstance(t, torch.Tensor)])

    def run() -> None:
        if isinstance(inputs, torch.Tensor):
            out = model(inputs)
        elif isinstance(inputs, Mapping):
            out = model(**inputs)
        else:
            out = model(*inputs)
        loss_fn(out).backward()
        if optimizer is not None:
            optimizer.step()

    model.zero_grad(set_to_none=True)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    return run, fake_mode
