"""Run a plan's module regions as their module called again (NOTE [module re-run] in
``remat.planner.rerun_regions``): the executor's path without a Python call per op.

While the plan runs, each such module's ``forward`` is wrapped: at the call the plan expects (the
forward's op count at the region's first op), the executor's dispatch mode steps aside, the call
runs bare under saved-tensor hooks that keep a handle per saved tensor (its shape, dtype and
version, not the tensor), and the count moves past the region. In backward, the first handle
unpacked runs the module again on the call's inputs, under the forward's random-number state,
autocast settings and allowed attention kernels, once every tensor the call read is checked
unwritten, keeping each tensor autograd saves (where autograd still holds its handle) until the
last one comes back, then it stops (before the last op's kernel where the saves were its
arguments: NOTE [early stop] in ``remat.manual.early_stop``); each unpack takes its own::

    forward:  runner (checks ops) | module(x) bare, pack: tensor -> handle i | runner ...
    backward: unpack(handle i) -> module(x') again, pack'(j) stores j ... stop after the last

Any other call of the module (outside the step, or where the count differs) runs it as it is,
under the executor's mode, which then checks and records it as a tape region.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.backends.cuda as backends
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat import aten
from remat._dispatch import saved_hooks
from remat._errors import RecomputationError, RematTypeError, message
from remat._modules import below
from remat.manual import autocast
from remat.manual.buffers import Buffers
from remat.manual.checks import TensorMeta
from remat.manual.inner_backward import refused
from remat.manual.inputs import Inputs
from remat.manual.traced import outside_transforms

__all__ = ["CallCheck", "run_again", "setting"]


class _Stop(Exception):
    """Raised inside the re-run once every saved tensor has been made again."""


class _Saved:
    """What autograd holds for a tensor a module region saved: it dies with its node, and the
    re-run then keeps nothing for it (NOTE [dead handles] in ``remat.manual.handles``)."""

    __slots__ = ("frame", "index", "__weakref__")

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame, self.index = frame, index


class _Frame:
    """One call of a module region: what running it again needs, and the handles it gave out."""

    def __init__(
        self, module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ):
        self.forward = forward
        read = [t for t in tree_leaves([args, kwargs]) if isinstance(t, torch.Tensor)]
        modules = below(module)  # walked once: for what the call reads and for its buffers
        read += [*module.parameters(), *module.buffers()]
        read += [t for m in modules for t in vars(m).values() if isinstance(t, torch.Tensor)]
        if any(t.is_inference() for t in read):
            raise RematTypeError(
                message(
                    "plan",
                    "a module run again cannot keep an inference tensor it reads",
                    f"{type(module).__name__} given or holding a tensor made under torch.inference_mode",
                    "make it outside inference mode, or plan without rerun_modules",
                )
            )
        # what the call reads must be as it was when it runs again (the tape checks the same)
        self.read = [(weakref.ref(t), t._version, TensorMeta.of(t)) for t in read]
        self.given = Inputs(args, kwargs)
        # buffers the call writes or binds anew (a running average ``self.ema = ...``): made again
        # from the values the call read, into throwaway copies (NOTE [buffers as the forward saw them])
        self.buffers = Buffers(tuple(modules), (module,))  # its forward runs without __call__
        # every call keeps the generators' state, whatever the trace drew: a module may draw where
        # it did not when traced (dropout whose rate rose from 0)
        self.rng = aten.capture_all()
        self.autocast = autocast.capture_autocast()
        self.attention = tuple(getattr(backends, f"{k}_sdp_enabled")() for k in _ATTENTION)
        self.metas: list[TensorMeta] = []
        self.versions: list[tuple[weakref.ref[torch.Tensor], int]] = []
        self.handles: list[weakref.ref[_Saved]] = []
        self.running = True
        self.made: dict[int, dict[int, torch.Tensor]] = {}  # graph task -> handle -> tensor
        self.lock = threading.Lock()

    def pack(self, t: torch.Tensor) -> _Saved:
        self.metas.append(TensorMeta.of(t))
        self.versions.append((weakref.ref(t), t._version))
        self.handles.append(weakref.ref(handle := _Saved(self, len(self.metas) - 1)))
        return handle

    def inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for ref, version, meta in self.read:
            _unwritten(
                ref,
                version,
                f"{meta}, read",
                "a tensor a module region read was modified in place before the module ran again",
                "modify it after backward, or clone it before the module reads it",
            )
        return self.given.again()

    def unpack(self, index: int) -> torch.Tensor:
        if self.running:
            raise _error(
                "backward reached a tensor saved by a module region whose call is still running",
                f"saved tensor #{index} {self.metas[index]}",
                "run backward after the forward",
            )
        ref, version = self.versions[index]
        _unwritten(
            ref,
            version,
            f"{self.metas[index]}, saved",
            "a tensor saved for backward was modified in place after it was saved",
            "clone it before modifying it, or use the out-of-place op",
        )
        task = torch._C._current_graph_task_id()
        with self.lock:
            made = self.made.get(task)
            if made is None or index not in made:
                if made is None and task >= 0:  # what this backward leaves unread goes with it
                    forget = functools.partial(_forget, weakref.ref(self), task)
                    torch.autograd.Variable._execution_engine.queue_callback(forget)
                made = self.made[task] = self.again()
            tensor = made.pop(index)
            if not made:
                del self.made[task]
            return tensor

    def again(self) -> dict[int, torch.Tensor]:
        """Run the module again up to its last save; every saved tensor, by handle."""
        made: dict[int, torch.Tensor] = {}
        total, count = len(self.metas), [0]

        def pack(t: torch.Tensor) -> None:
            i = count[0]
            count[0] += 1
            if i >= total:
                raise _Stop
            meta = TensorMeta.of(t)
            if meta != self.metas[i]:
                raise _error(
                    "a tensor made again differs from the forward's",
                    f"saved tensor #{i}: forward {self.metas[i]}, again {meta}",
                    "the module must compute the same shapes in forward and backward",
                )
            if self.handles[i]() is not None:  # else its node is gone: none will unpack it
                made[i] = t.detach()
            if i == total - 1:  # the planner runs no module again whose last save's op may fill it
                raise _Stop

        args, kwargs = self.inputs()
        try:
            with (
                aten.replayed(self.rng),
                autocast.autocast_replayed(self.autocast),
                _attention(self.attention),
                torch.enable_grad(),
                self.buffers.shielded(),
                saved_hooks(pack, _never),
                refused("plan"),  # NOTE [backward run again] in remat.manual.inner_backward
                outside_transforms(),
            ):
                self.forward(*args, **kwargs)
        except _Stop:
            pass
        if count[0] < total:
            raise _error(
                "the module saved fewer tensors for backward when run again",
                f"{count[0]} of {total}",
                "make the module take the same path in forward and backward",
            )
        return made


# the scaled-dot-product attention kernels allowed (``torch.nn.attention.sdpa_kernel`` sets them)
_ATTENTION = ("flash", "mem_efficient", "math", "cudnn")


@contextlib.contextmanager
def _attention(allowed: tuple[bool, ...]) -> Iterator[None]:
    """The attention kernels the forward was allowed, while the module runs again."""
    outer = tuple(getattr(backends, f"{k}_sdp_enabled")() for k in _ATTENTION)
    try:
        for k, on in zip(_ATTENTION, allowed, strict=True):
            getattr(backends, f"enable_{k}_sdp")(on)
        yield
    finally:
        for k, on in zip(_ATTENTION, outer, strict=True):
            getattr(backends, f"enable_{k}_sdp")(on)


def _forget(frame: weakref.ref[_Frame], task: int) -> None:
    alive = frame()
    if alive is not None:
        with alive.lock:
            alive.made.pop(task, None)


def _never(packed: object) -> torch.Tensor:  # pragma: no cover - the re-run's graph is never run
    raise RuntimeError("remat internal: the re-run's own graph is never differentiated")


def _unpack(packed: _Saved) -> torch.Tensor:
    return packed.frame.unpack(packed.index)


def _unwritten(ref: weakref.ref[torch.Tensor], version: int, what: str, rule: str, todo: str) -> None:
    """Raise ``rule`` if the tensor ``ref`` names (when alive) is no longer at ``version``."""
    t = ref()
    if t is not None and t._version != version:
        raise _error(rule, f"{what} at version {version}, now at {t._version}", todo)


def _error(rule: str, given: str, todo: str) -> RecomputationError:
    return RecomputationError(message("plan", rule, given, todo))


def run_again(
    module: nn.Module,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    check: CallCheck | None = None,
) -> Any:
    """Run one call of a module region: ``forward(*args, **kwargs)`` keeping a handle for each
    tensor autograd saves, to be made again in backward (see the module doc); with ``check``, its
    ops checked against the traced call's (NOTE [a call run bare is checked once])."""
    frame = _Frame(module, forward, args, kwargs)
    try:
        with (
            frame.buffers.noting(),
            saved_hooks(frame.pack, _unpack),
            check if check is not None else contextlib.nullcontext(),
        ):
            out = forward(*args, **kwargs)
        if check is not None:
            check.done()
        return out
    finally:
        frame.running = False


class CallCheck(TorchDispatchMode):
    """Checks the ops of one call run bare against the traced call's ``expected`` op names and the
    dtype and shape of each one's first result (``shapes``, empty where not known; ``made`` reads
    an op's result as the executor does), counting as the executor counts (``skip``: names not
    counted; ops inside autograd nodes and of skipped namespaces pass).

    NOTE [a call run bare is checked once] The call runs without the executor's op-by-op check, so
    a call that takes another path than the traced one (dropout on where the plan was made in eval
    mode, autocast on where it was off) would run unseen, holding what the plan did not count. Each
    module region is checked op by op the first time it runs in each setting its path depends on
    and the executor can see (the key ``setting`` gives): the train or eval mode of its modules,
    the rates of its dropout modules, the autocast state and the attention kernels allowed; later
    calls in the same setting run bare. A path that changes with the data alone (a branch on a
    tensor's values, another batch size inside the module: the ops after it are checked) or with
    other Python state is not seen after the first check, as with ``torch.utils.checkpoint``; the
    tape's regions check every call."""

    def __init__(
        self,
        expected: Sequence[str],
        shapes: Sequence[str],
        made: Callable[[Any, aten.OpFacts], str | None],
        skip: frozenset[str],
        name: str,
        first: int,
    ) -> None:
        super().__init__()
        self.expected, self.shapes, self.made = expected, shapes, made
        self.skip, self.name, self.first = skip, name, first
        self.position = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        info = aten.facts(func)
        if not (info.skipped or info.name in self.skip or torch._C._current_autograd_node() is not None):
            i = self.position
            self.position += 1
            if i >= len(self.expected) or self.expected[i] != info.name:
                want = self.expected[i] if i < len(self.expected) else "no more ops"
                raise self._diverged(f"op #{self.first + i}: expected {want}, got {info.name}")
            out = func(*args, **(kwargs or {}))
            want = self.shapes[i] if i < len(self.shapes) else ""
            if want and (got := self.made(out, info)) is not None and got != want:
                raise _error(
                    "each op makes the dtype and shape of the traced step (the plan's memory is theirs)",
                    f"{self.name}, run again as a module: op #{self.first + i} {info.name} made {got}, "
                    f"planned {want}",
                    "plan again for this batch size, model and dtype",
                )
            return out
        return func(*args, **(kwargs or {}))

    def done(self) -> None:
        if self.position != len(self.expected):
            raise self._diverged(f"{self.position} of its {len(self.expected)} traced ops ran")

    def _diverged(self, what: str) -> RecomputationError:
        return _error(
            "the model's forward diverged from the traced step",
            f"{self.name}, run again as a module: {what}",
            "plan again with inputs that take this path (control flow, shapes, train or eval mode)",
        )


def setting(module: nn.Module) -> tuple[object, ...]:
    """What a module region's checked ops depend on (NOTE [a call run bare is checked once]):
    each of its modules' train or eval mode and dropout rate, the autocast state and the attention
    kernels allowed."""
    modes = tuple((m.training, m.p if isinstance(m, _DROPOUTS) else None) for m in below(module))
    kernels = tuple(getattr(backends, f"{k}_sdp_enabled")() for k in _ATTENTION)
    return (modes, autocast.capture_autocast(), kernels)


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
