"""Record one training step under a dispatch mode: every ATen op, the storages it reads, makes and
mutates, and the moment the program lets go of each one.

Why a dispatch mode and not a graph capture (torch.fx, torch.compile): what rematerialization
trades is memory, and memory is decided by eager PyTorch itself: which tensors autograd saves,
when its engine frees them, views, in-place ops, the optimizer's state. A TorchDispatchMode sees
every ATen op that runs, forward, backward (the engine runs inside the mode) and optimizer alike,
on real or fake tensors, and finalizers on storage objects say when memory dies. What an op is
(its aliases, writes, randomness, purity) the recorder reads from ``remat.aten``; which phase and
module issued it, from ``remat.trace.attribution``.

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

NOTE [CUDA block size]
The CUDA caching allocator hands out blocks in multiples of 512 bytes and counts the blocks
(``torch.cuda.memory_allocated``), so a storage on CUDA is recorded at its block's size: a tensor
of 100 bytes takes 512, which matters on models of many small tensors.

NOTE [scratch of a single run]
What an op's kernel allocates and frees while it runs (``Op.scratch``) is measured under the
allocator's account (``remat._allocator``) once per signature: the op, its tensors' geometry and
its other arguments, taken before the op runs (an in-place op may change its argument's geometry).
A pure op is measured on one more run; an op that cannot run again (a random draw such as
attention with dropout, a mutation) on its one run, its time then including the profiler's notes of
its allocations, and later ones of its signature take what was learned: none runs twice.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import BackwardCFunction
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat import aten
from remat._allocator import measured, scratch_of
from remat._errors import RematRuntimeError, RematValueError, message
from remat.aten.scratch import known, learn, signature
from remat.trace.attribution import Attribution, hooked, phases
from remat.trace.op_time import run_timed
from remat.trace.types import Op, Phase, Release, TensorInfo, Trace

__all__ = ["CALL_VALUES", "Recorder"]

CUDA_BLOCK = 512  # bytes: the CUDA allocator's smallest block and its rounding (NOTE [CUDA block size])


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
    device_cost: float | None  # on CUDA: the kernels' time on the device (NOTE [CUDA op time])


# What a module call may be given for the planner to know what running it again holds (and a bare
# forward what its path depends on: NOTE [bare forward]): tensors, and values that hold none
_VALUES = (type(None), bool, int, float, complex, str, bytes, enum.Enum)
CALL_VALUES = (torch.Tensor, *_VALUES, torch.dtype, torch.device, torch.layout, torch.memory_format)


class Recorder(TorchDispatchMode):
    """Records ops and storage deaths; see NOTE [trace identity]. Not ``hold_saved``: autograd keeps
    nothing it saves (``remat.trace.let_go``), and no backward may run."""

    hold_saved = True

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
        self.wrapping: tuple[weakref.ref[torch.Tensor], _OpRecord, tuple[tuple[str, int], ...]] | None = None
        self.op_module: list[str] = []  # per tensor id: module path of the op that made it
        self.attribution = Attribution(self.called)
        self.call_inputs: dict[str, tuple[int, ...]] = {}  # per named module: its first call's
        self.own_generator: set[str] = set()  # modules that drew from a generator passed to an op
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
            TensorInfo(hid, nbytes, alias_of, constant, tuple(t.shape), aten.dtype_name(t.dtype))
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
        nbytes = storage.nbytes()
        if t.is_cuda:  # NOTE [CUDA block size]
            nbytes = -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK
        return self._new_handle(t, key, nbytes, None, constant)

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
        self._wrapped()
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        # ``torch.tensor(0.5)`` in the step: the tensor it made just now is lifted's, not a constant
        lifted = facts.packet == "aten.lift_fresh" and len(leaves) == 1 and not self._known(leaves[0])
        handles = [None] if lifted else [self.handle(t) for t in leaves]
        written = [
            (t, h)
            for t in aten.written_tensors(facts.writes, args, kwargs)
            if (h := self.handle(t)) is not None
        ]
        random = aten.draws(facts, args, kwargs)  # NOTE [no dropout draws nothing] in ``remat.aten.schema``
        if random and any(isinstance(a, torch.Generator) for a in tree_leaves((args, kwargs))):
            # a generator of the program's own, which a module run again would draw from anew
            self.own_generator.update(self.attribution.modules)
        pure = facts.pure  # safe to run again (NOTE [hidden writes] in ``remat.aten.schema``)
        measures = self.scratch and leaves and not (leaves[0].is_meta or is_fake(leaves[0]))
        # the key is taken before the op runs: an in-place op may change its argument's geometry
        key = signature(func, args, kwargs) if measures else None
        nbytes = known(key) if key is not None else None
        if key is None or nbytes is not None or pure:
            out, seconds, on_device = run_timed(func, args, kwargs, leaves, self.repeats if pure else 1)
            if key is not None and nbytes is None and seconds > 0:  # pure: one more run measures it
                once = scratch_of(lambda: func(*args, **kwargs), leaves[0].device)
                nbytes = None if once is None else learn(key, once)
            scratch = (nbytes or 0) if seconds > 0 else 0
        else:  # NOTE [scratch of a single run]
            (out, seconds, on_device), nbytes = measured(
                lambda: run_timed(func, args, kwargs, leaves, 1), leaves[0].device
            )
            scratch = 0 if nbytes is None or not seconds else learn(key, nbytes)
        numbers = aten.wrapped_numbers(facts, args, kwargs)  # NOTE [wrapped numbers]
        node = torch._C._current_autograd_node() if numbers and scratch else None
        if node is not None and not isinstance(node, BackwardCFunction) and leaves[0].device.type == "cpu":
            scratch = max(0, scratch - sum(n for _, n in numbers))  # a formula's: the saved one, handed back
        for t, h in written:  # in-place view ops (t_, squeeze_, as_strided_) change the geometry
            self._rebind(t, h)
            grown = aten.storage_of(t)  # (a CUDA storage's count is rounded up: never less)
            if grown is not None and grown.nbytes() > self.tensors[self.storages[grown._cdata].owner].nbytes:
                raise _resized(grown.nbytes(), self.tensors[self.storages[grown._cdata].owner].nbytes)
        returns = tuple(
            (not fresh and not w and not lifted, w)
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
        phase, module = self.attribution.where()
        for h in outputs:
            self.op_module[h] = module
        inputs = tuple(h for h in handles if h is not None)
        mutates = tuple(dict.fromkeys(h for _, h in written))
        record = _OpRecord(
            str(func), inputs, tuple(outputs), mutates, seconds, phase, module, random, scratch, on_device
        )
        self.events.append(record)
        first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        if numbers and torch.is_grad_enabled() and first is not None and first.device.type == "cpu":
            self.wrapping = (weakref.ref(first), record, numbers)
        if phase in (Phase.FORWARD, None) and torch.is_grad_enabled():
            self.attribution.tag_nodes(
                (t, self.op_module[h]) for t, h in zip(leaves, handles, strict=True) if h is not None
            )
        self.n_ops += 1
        if self.progress is not None and self.n_ops % 256 == 0:
            self.progress(self.n_ops)
        return out

    def _wrapped(self) -> None:
        """The numbers the op before was given in a tensor's place that its autograd node saved, as
        made by that op (NOTE [wrapped numbers] in ``remat.aten.schema``)."""
        if self.wrapping is None:
            return
        (ref, record, numbers), self.wrapping = self.wrapping, None
        node = getattr(ref(), "grad_fn", None)
        for name, _ in numbers if node is not None else ():
            saved = None
            with contextlib.suppress(RuntimeError):  # already freed, by a backward of its own
                saved = getattr(node, f"_saved_{name}", None)
            storage = aten.storage_of(saved) if isinstance(saved, torch.Tensor) and saved.dim() == 0 else None
            if storage is not None and storage._cdata not in self.storages:
                made = self._new_storage(saved, storage, constant=False)  # type: ignore[arg-type]
                self.op_module[made] = record.module
                record.outputs += (made,)
                record.scratch = max(0, record.scratch - storage.nbytes())  # its run again made it too

    def _rebind(self, t: torch.Tensor, hid: int) -> None:
        rec = self.storages.get(self.storage_key[hid])
        if rec is not None:
            rec.by_geometry[aten.geometry(t)] = hid
            rec.impls.append(t._cdata)
            self.impl[t._cdata] = hid

    # -- saved tensors, hooks, the trace ------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """Saved-tensor hook: note that autograd saved ``t`` now; keep it, with its version, unless
        not ``hold_saved``."""
        h = self.handle(t)
        if h is not None:
            self.saved.add(h)
            self.saved_at.append((h, self.n_ops))
        return (t, t._version) if self.hold_saved else None

    def called(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """Forward hook: note the tensors a named module's first call was given (what running the
        call again holds, NOTE [module re-run] in ``remat.planner.rerun_regions``)."""
        name = self.attribution.names.get(module)
        if name is None or module in self.attribution.roots or name in self.call_inputs:
            return
        if hooked(module, self.called):  # its call runs more than its forward: not run again
            return
        leaves = tree_leaves((args, kwargs))
        if not all(isinstance(x, CALL_VALUES) for x in leaves):  # an object may hold tensors unseen
            return
        given = [t for t in leaves if isinstance(t, torch.Tensor) and self._known(t)]
        self.call_inputs[name] = tuple(sorted({h for t in given if (h := self.handle(t)) is not None}))

    def _known(self, t: torch.Tensor) -> bool:
        storage = aten.storage_of(t)
        return storage is not None and storage._cdata in self.storages

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Record while the context is open: this mode, the saved-tensor hook and attribution."""
        try:
            with (
                self.attribution.hooks(),
                torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack),
                self,
            ):
                yield
        finally:
            self._wrapped()
            for fin in self.finalizers:
                fin.detach()

    def trace(self, name: str) -> Trace:
        """What was recorded, as a Trace named ``name`` (costs not yet estimated)."""
        ops = [e for e in self.events if isinstance(e, _OpRecord)]
        resolved = phases([e.phase for e in ops])
        # NOTE [CUDA op time] (``remat.trace.op_time``): the device's times where it is the bottleneck
        host_s = sum(e.cost for e in ops)
        device_s = sum(e.cost if e.device_cost is None else e.device_cost for e in ops)
        device_bound = device_s > host_s
        events: list[Op | Release] = []
        index = 0
        for e in self.events:
            if isinstance(e, Release):
                events.append(e)
                continue
            cost = e.device_cost if device_bound and e.device_cost is not None else e.cost
            fields = (e.name, e.inputs, e.outputs, e.mutates, cost, 0.0, resolved[index], e.module)
            events.append(Op(index, *fields, e.random, e.scratch))
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
            tuple(self.attribution.calls.items()),
            tuple((k, v) for k, v in self.call_inputs.items() if k not in self.own_generator),
        )


def _resized(now: int, counted: int) -> RematValueError:
    """A storage an op grew in place (``resize_``, an ``out=`` tensor smaller than the result): the
    trace gives each storage one size, from the op that made it."""
    return RematValueError(
        message(
            "trace.capture",
            "an op changed the size of a tensor's storage in place, which the trace cannot follow",
            f"a storage of {counted} bytes taken to {now}",
            "make the tensor at its final size (not resize_, nor an out= tensor of another size)",
        )
    )


def _unpack(packed: Any) -> torch.Tensor:
    """A saved tensor back for backward, refused as autograd refuses it where an in-place op wrote
    it since it was saved (hooks take autograd's own check away): the step would fail unrecorded."""
    if packed is None:  # not held (``hold_saved``): nothing to give back
        return packed  # type: ignore[return-value]
    t, version = packed
    if t._version != version:
        raise RematRuntimeError(
            message(
                "trace.capture",
                "a tensor autograd saved for backward was modified by an in-place operation since, "
                "which autograd refuses",
                f"{aten.describe(t.dtype, t.shape)} at version {t._version}, saved at version {version}",
                "clone it before modifying it, as the step must without remat too",
            )
        )
    return t
