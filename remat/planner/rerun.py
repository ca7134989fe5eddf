"""A plan's region that is exactly one module's call (NOTE [one call]) run as the module's re-run.

Why not the tape (``remat.manual.tape``) that the executor records other regions on: a region
that is a whole call of a module can be recomputed by calling the module's forward again, as
``torch.utils.checkpoint`` does, with no op recorded in forward; the tape's per-op record (its
arguments, a generator state per random op) is what made such plans slower than per-layer
checkpointing. What the re-run holds is what ``remat.planner.region_model`` and
``remat.planner.predict`` predict:

- the call's tensor arguments that an op of the call read (``saw``), until the last handle is
  gone; an argument no op read is held weakly, as the region's tape would not hold it;
- per generator a random op of the call drew from, its state just before the first such op;
- no snapshot in forward: buffers are written by the forward as in the plain step, and the re-run
  writes into throwaway copies (``remat.manual.buffers``).

Autograd's saves go through this frame's hooks for the whole call, but only those of the tape's
window (NOTE [region end] in ``remat.planner.execute``: after the first op starts and up to the
last op's inputs) become handles; the first op's saves of its inputs and the last op's of its
outputs stay as in the plain step. In backward, the first handle unpacked re-runs the forward
from the held arguments under the same generator and autocast state, keeps what the handles stand
for, and stops at the last one::

    forward:  module(x) -> CallFrame.run: hooks on; saves in the window -> handle j
    backward: unpack(handle j) -> re-run forward(x) with hooks: the k-th save of the call is
              the k-th save of the forward; kept if it was a handle; stop after the last handle
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from remat import aten
from remat._errors import RecomputationError, RematRuntimeError, message
from remat.manual import autocast
from remat.manual.buffers import buffers_shielded

__all__ = ["CallFrame"]


class _Stop(Exception):
    """Raised inside the re-run once every handle's tensor is made again."""


class _Handle:
    """What autograd stores in place of a saved tensor of the window."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: CallFrame, index: int) -> None:
        self.frame = frame
        self.index = index


class _Unread:
    """A tensor argument no op of the call read: held weakly; if it is gone by backward, the
    re-run gets a meta tensor of its shape in its place (no op reads it there either: the forward's
    ops were checked one by one), so that holding it costs no memory the region's model lacks."""

    __slots__ = ("dtype", "ref", "requires_grad", "size", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)
        self.size, self.stride, self.dtype = t.shape, t.stride(), t.dtype
        self.requires_grad = t.requires_grad

    def get(self) -> torch.Tensor:
        t = self.ref()
        if t is None:
            t = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device="meta")
        return t.detach().requires_grad_(self.requires_grad)


def _pack(frame: weakref.ref[CallFrame], t: torch.Tensor) -> Any:
    alive = frame()
    return alive.pack(t) if alive is not None else t.detach()


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Handle):
        return packed.frame.unpack(packed.index)
    return packed  # type: ignore[no-any-return]


class CallFrame:
    """One call of a module run as a recomputed region: ``position()`` is the executor's count of
    the forward's ops, and saves while it is in ``first < p <= last`` become handles."""

    def __init__(
        self, forward: Callable[..., Any], position: Callable[[], int], first: int, last: int
    ) -> None:
        self.forward = forward
        self.position = position
        self.first, self.last = first, last
        self.slots: list[int] = []  # per save of the call: its handle, or -1 (kept as in the plain step)
        self.metas: list[tuple[torch.Size, torch.dtype]] = []  # per handle
        self.unread: dict[int, int] = {}  # id of a tensor argument no op read yet -> its slot
        self.sources: dict[Any, None] = {}  # generators a random op drew from, in order
        self.states: list[tuple[Any, torch.Tensor]] = []
        self.autocast = autocast.capture_autocast()
        self.structure: Any = None
        self.held: list[Any] = []
        self.versions: list[tuple[int, int]] = []
        self.stores: dict[int, dict[int, torch.Tensor]] = {}

    # -- forward ---------------------------------------------------------------------------------

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the forward with the window's saves as handles; keep what its re-run needs."""
        flat, self.structure = pytree.tree_flatten((args, kwargs))
        self.unread = {id(a): i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)}
        # every save under the hooks keeps the pack hook: one that held the frame would keep it,
        # and what it holds, alive as long as the first op's saves of its inputs
        frame = weakref.ref(self)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _pack(frame, t), _unpack):
            out = self.forward(*args, **kwargs)
        self.held = [_Unread(a) if isinstance(a, torch.Tensor) and id(a) in self.unread else a for a in flat]
        self.versions = [(i, a._version) for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        self.unread = {}
        return out

    def saw(self, args: tuple[Any, ...], kwargs: dict[str, Any], random: bool) -> None:
        """An op of the call is about to run: note which arguments it reads, and the state of the
        generator a random op draws from, the first time one does."""
        if self.unread:
            for a in args:
                if isinstance(a, (list, tuple)):
                    for b in a:
                        self.unread.pop(id(b), None)
                else:
                    self.unread.pop(id(a), None)
            for a in kwargs.values():
                self.unread.pop(id(a), None)
        if random:
            source = aten.source_of(args, kwargs)
            if source not in self.sources:
                self.sources[source] = None
                self.states.extend(aten.capture((source,)).states)

    def pack(self, t: torch.Tensor) -> Any:
        p = self.position()
        if not self.first < p <= self.last:
            # detached: a saved output kept as itself would hold its own node in a cycle autograd
            # cannot see (its own saves keep outputs without one)
            self.slots.append(-1)
            return t.detach()
        self.slots.append(len(self.metas))
        self.metas.append((t.shape, t.dtype))
        return _Handle(self, len(self.metas) - 1)

    # -- backward --------------------------------------------------------------------------------

    def unpack(self, index: int) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        store = self.stores.get(task)
        if store is None or index not in store:
            store = self.stores[task] = {}
            self.rerun(store)
        return store.pop(index)

    def _inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        flat = list(self.held)
        for i, version in self.versions:
            a = flat[i]
            if isinstance(a, _Unread):
                flat[i] = a.get()
                continue
            if a._version != version:
                raise RematRuntimeError(
                    message(
                        "plan.apply",
                        "an argument of a recomputed module call was modified in place after the call",
                        f"argument #{i} at version {a._version}, called at {version}",
                        "clone it before modifying it",
                    )
                )
            flat[i] = a.detach().requires_grad_(a.requires_grad)
        args, kwargs = pytree.tree_unflatten(flat, self.structure)
        return args, kwargs

    def rerun(self, store: dict[int, torch.Tensor]) -> None:
        """Call the forward again and keep, by handle, the tensors the forward's saves were."""
        slots, total = self.slots, len(self.metas)
        counter = [0]

        def pack_again(t: torch.Tensor) -> torch.Tensor:
            k = counter[0]
            counter[0] += 1
            j = slots[k] if k < len(slots) else total
            if j < 0:
                return t.detach()
            if j >= total or (t.shape, t.dtype) != self.metas[j]:
                raise RecomputationError(
                    message(
                        "plan.apply",
                        "a recomputed module call saved other tensors than its forward",
                        f"save #{k}: forward {self.metas[j] if j < total else 'none'}, "
                        f"recomputed {(t.shape, t.dtype)}",
                        "make the module compute the same ops in forward and backward",
                    )
                )
            kept = store[j] = t.detach()
            if j == total - 1:
                raise _Stop
            return kept

        args, kwargs = self._inputs()
        try:
            with (
                aten.replayed(aten.RngState(tuple(self.states))) if self.states else contextlib.nullcontext(),
                autocast.autocast_replayed(self.autocast),
                buffers_shielded(),
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(pack_again, lambda t: t),
            ):
                self.forward(*args, **kwargs)
        except _Stop:
            pass
        if len(store) < total:
            raise RecomputationError(
                message(
                    "plan.apply",
                    "a recomputed module call saved fewer tensors than its forward",
                    f"{len(store)} of {total}",
                    "make the module compute the same ops in forward and backward",
                )
            )
