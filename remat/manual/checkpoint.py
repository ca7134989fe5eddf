"""``remat.checkpoint``: run a function without keeping its insides, recompute them in backward.

Like ``torch.utils.checkpoint(use_reentrant=False)``, the function runs once in forward with autograd
recording as usual, but every tensor autograd saves for backward is replaced by a small handle (a
saved-tensors pack hook). When backward first asks for one of them, the function runs again from its
inputs and the handles are filled in; the original autograd graph then uses the recomputed tensors.
Differences from torch's version, each a bug report there:

- module buffers (batch-norm running statistics, ``num_batches_tracked``) are updated once, in forward;
- the RNG of the CPU and every CUDA device and the autocast settings are replayed, the caller's RNG kept;
- ``policy=`` keeps the outputs of chosen ops (e.g. matmuls) instead of recomputing them, on the device
  (SAVE) or in host memory (OFFLOAD, see ``remat.manual.selective``);
- ``check="values"`` compares each recomputed tensor with a fingerprint of the forward's and names the op
  and module that diverged; shapes and dtypes are always checked;
- the recomputation stops at the last save as torch's does (NOTE [early stop] in ``manual.early_stop``).

Saved tensors stay at hand until the function returns, so that a backward inside it (a gradient penalty,
MAML's inner step) uses them; the recomputation holds as many at its end, so the peak is unchanged (a
``.backward()`` run again is refused: NOTE [backward run again]). A
saved tensor written in place after it was saved is refused, as autograd refuses it. The recomputation
runs once per backward (graph task) and stops at the last saved tensor::

    forward:   x ──fn (pack: tensor -> handle i)──> y          frame keeps: inputs, RNG, autocast
    backward:  node.unpack(handle i) ─> frame.recompute() ─> fn(x') under the same state,
               pack'(tensor j) stores j ... stops at the last j ─> returns tensor i
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from remat import aten
from remat._dispatch import no_modes, saved_hooks
from remat._errors import RecomputationError, RematError, RematRuntimeError, RematTypeError, message
from remat._module_path import ModulePaths
from remat.host.offloader import Offloader
from remat.manual import autocast, keywords
from remat.manual.buffers import Buffers, region_modules
from remat.manual.checks import Check, Provenance, TensorMeta, compare_values
from remat.manual.early_stop import LastOp
from remat.manual.inner_backward import refused
from remat.manual.inputs import Inputs, Unwritten, carried, failed_again
from remat.manual.keywords import Settings
from remat.manual.own_generators import own_generators
from remat.manual.plainly import plain
from remat.manual.reach import held
from remat.manual.scope import joining, recording
from remat.manual.selective import Recording, Replaying, SaveCache
from remat.manual.traced import compiled_frames, eagerly, outside_transforms, transformed, under_compile
from remat.policy import Policy, RecomputeAll

__all__ = ["checkpoint", "checkpointed", "run"]

F = TypeVar("F", bound=Callable[..., Any])


class _StopRecomputation(Exception):
    """Raised inside the recomputation once every saved tensor has been produced again."""


class _Handle:
    """What autograd stores in place of a saved tensor; it dies with its node (NOTE [dead handles]
    in ``remat.manual.handles``), and a recomputation then keeps nothing for it."""

    __slots__ = ("frame", "index", "__weakref__")

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame, self.index = frame, index


class _Frame:
    """Everything needed to run one checkpointed call again."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        policy: Policy | None,
        check: Check,
        preserve_rng: bool,
        offloader: Offloader | None = None,
    ) -> None:
        self.fn, self.check = fn, check
        self.given = Inputs(args, kwargs)  # every tensor, at any depth, held through autograd
        reach = held(fn)  # what its closure, defaults and globals hold
        modules = region_modules(fn, args, kwargs, reach)
        self.modules = modules[0]  # their parameters: ``Unwritten`` as the call starts, and ends
        self.parameters = Unwritten(self.modules, [*reach, *carried(self.given.leaves)])  # by reference
        # a lazy module's first forward draws its weights from the region's generators: run plainly
        self.lazy = any(isinstance(m, LazyModuleMixin) and m.has_uninitialized_params() for m in modules[0])
        self.buffers = Buffers(*modules)  # NOTE [buffers as the forward saw them]
        generators = own_generators(fn, args, kwargs, modules[0], reach) if preserve_rng else None
        self.rng = aten.capture_all(generators) if generators is not None else None
        self.autocast = autocast.capture_autocast()
        self.joined = recording()  # NOTE [a scope joined again]
        self.cache = (
            None if policy is None or isinstance(policy, RecomputeAll) else SaveCache(policy, offloader)
        )
        self.metas: list[TensorMeta] = []
        self.handles: list[weakref.ref[_Handle]] = []  # per saved tensor: what autograd holds
        self.last_op, self.stops = LastOp(), False  # NOTE [early stop]: set as the forward ends
        # per saved tensor: it, its base if it is a view (the same version counter), its version
        self.written: list[tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor] | None, int]] = []
        # NOTE [backward inside the forward]: a function may differentiate its own graph (a
        # gradient penalty, MAML's inner step); until it returns, saved tensors stay at hand for
        # that. The recomputation keeps its own graph's tensors the same way.
        self.live: list[torch.Tensor] | None = []
        self.prints: list[torch.Tensor | None] = []
        self.origins: list[str] = []  # with ``check="values"``: what made each saved tensor
        self.provenance = Provenance() if check == "values" else None
        self.recomputed: dict[int, dict[int, torch.Tensor]] = {}
        self.again: dict[int, int] = {}  # per saved tensor, its version when the recomputation saved it

    def inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        try:
            return self.given.again()
        except RuntimeError as error:  # autograd's version check on the inputs
            raise _written("an input of the checkpointed function", str(error)) from error

    def pack(self, t: torch.Tensor) -> _Handle:
        self.metas.append(TensorMeta.of(t))
        self.written.append((weakref.ref(t), None if t._base is None else weakref.ref(t._base), t._version))
        if self.live is not None:
            self.live.append(t)
        if self.provenance is not None:
            self.origins.append(self.provenance.describe(t))
        self.handles.append(weakref.ref(handle := _Handle(self, len(self.metas) - 1)))
        self.last_op.saved(t)
        return handle

    def unpack(self, handle: _Handle) -> torch.Tensor:
        # NOTE [saved and then written]: autograd refuses a saved tensor written in place after it
        # was saved; the recomputation would hide the write, so remat checks the version itself:
        # the forward's tensor's, or where the program let go of it, the recomputed one's since
        # the recomputation saved it (it ran the write too, where a later save needed it)
        ref, base, version = self.written[handle.index]
        source = ref()
        if source is None and base is not None:  # a dead view: its base has the same version counter
            source = base()
        self.unwritten(handle.index, source, version)
        if self.live is not None:
            return self.live[handle.index]
        task = torch._C._current_graph_task_id()
        store = self.recomputed.get(task)
        if store is None or handle.index not in store:
            if store is None and task >= 0:  # what this backward leaves unread goes with it
                forget = functools.partial(_forget, weakref.ref(self), task)
                torch.autograd.Variable._execution_engine.queue_callback(forget)
            store = {}
            if task >= 0:  # outside a backward (a saved tensor read by a tool): kept by none
                self.recomputed[task] = store
            self.recompute(store)
        again = store.pop(handle.index)
        self.unwritten(handle.index, again if source is None else None, self.again[handle.index])
        return again

    def unwritten(self, index: int, t: torch.Tensor | None, version: int) -> None:
        if t is not None and t._version != version:
            where = self.origins[index] if self.origins else f"saved tensor #{index}"
            raise _written(where, f"{self.metas[index]} at version {t._version}, saved at {version}")

    def recompute(self, store: dict[int, torch.Tensor]) -> None:
        total = len(self.metas)
        counter = [0]

        def pack_again(t: torch.Tensor) -> torch.Tensor:
            i = counter[0]
            counter[0] += 1
            if i >= total:
                raise _StopRecomputation
            ran = aten.made_last(t) or self.stops  # NOTE [early stop] in ``remat.manual.early_stop``
            with no_modes():  # our own ops are not the program's
                self.verify(i, t)
                kept, self.again[i] = t.detach(), t._version
                if self.handles[i]() is not None:  # else its node is gone: none will unpack it
                    store[i] = kept
            if i == total - 1 and ran:
                raise _StopRecomputation
            return kept

        def unpack_again(kept: torch.Tensor) -> torch.Tensor:  # a backward inside the function
            return kept

        self.parameters.check("checkpoint")
        args, kwargs = self.inputs()
        replay = Replaying(self.cache, "checkpoint") if self.cache is not None else None
        try:
            with (
                aten.replayed(self.rng) if self.rng is not None else contextlib.nullcontext(),
                autocast.autocast_replayed(self.autocast),
                self.buffers.shielded(),
                self.parameters.restored("checkpoint"),
                torch.enable_grad(),
                saved_hooks(pack_again, unpack_again),
                joining() if self.joined else contextlib.nullcontext(),
                refused("checkpoint"),  # NOTE [backward run again]
                outside_transforms(),
                replay if replay is not None else contextlib.nullcontext(),
            ):
                eagerly(self.fn, args, kwargs)
        except _StopRecomputation:
            pass
        except RematError:
            raise
        except RuntimeError as error:  # from torch, in the function run again: NOTE [inputs cut]
            raise failed_again("checkpoint", error) from error
        if self.prints:  # once the ops have run: an op may write what it saved after the save
            with no_modes():
                compare_values(self.prints, self.origins, store)
        if counter[0] < total:
            rule = "the recomputation saved fewer tensors for backward than the forward"
            hint = "make the checkpointed function compute the same ops in forward and backward"
            raise RecomputationError(message("checkpoint", rule, f"{counter[0]} of {total}", hint))

    def verify(self, i: int, t: torch.Tensor) -> None:
        meta = TensorMeta.of(t)
        if self.check != "none" and meta != self.metas[i]:
            rule, given = "a recomputed tensor differs from the forward's", f"forward {self.metas[i]}"
            hint = "the checkpointed function must compute the same shapes in forward and backward "
            hint += "(no state that changes between calls)"
            raise RecomputationError(
                message("checkpoint", rule, f"saved tensor #{i}: {given}, recomputed {meta}", hint)
            )


def _written(what: str, given: str) -> RematRuntimeError:
    rule = f"a tensor saved for backward ({what}) was modified in place after it was saved"
    todo = "clone it before modifying it, or modify it after backward (autograd raises here too, unless "
    todo += "under allow_mutation_on_saved_tensors, which remat.checkpoint does not follow)"
    return RematRuntimeError(message("checkpoint", rule, given, todo))


def _unpack(handle: _Handle) -> torch.Tensor:
    return handle.frame.unpack(handle)


def _forget(frame: weakref.ref[_Frame], task: int) -> None:
    alive = frame()
    if alive is not None:
        alive.recomputed.pop(task, None)


def run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    policy: Policy | None,
    check: Check,
    preserve_rng: bool = True,
    offloader: Offloader | None = None,
    root: object = None,  # what names the modules a policy is told of (NOTE [module paths]): fn if None
) -> Any:
    """Run one checkpointed call (no argument checks; the forms of ``checkpoint`` end here)."""
    off = not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or plain()
    if not off and (torch.compiler.is_compiling() or compiled_frames()):  # NOTE [under torch.compile]
        again = functools.partial(run, fn, args, kwargs, policy, check, preserve_rng, offloader, root)
        return under_compile(fn, args, kwargs, policy, preserve_rng, again)
    if off or transformed():
        return fn(*args, **kwargs)
    frame = _Frame(fn, args, kwargs, policy, check, preserve_rng, offloader)
    if frame.lazy:
        return fn(*args, **kwargs)
    try:
        with contextlib.ExitStack() as forward:
            forward.enter_context(saved_hooks(frame.pack, _unpack))
            forward.enter_context(frame.buffers.noting())
            if frame.provenance is not None:
                forward.enter_context(frame.provenance.tracking(fn))
            if frame.cache is not None:
                forward.enter_context(Recording(frame.cache, ModulePaths(fn if root is None else root)))
            out = fn(*args, **kwargs)
        frame.parameters.again()
        return out
    finally:
        if frame.provenance is not None and frame.live is not None:  # the values the function left
            with no_modes():
                frame.prints = [frame.provenance.checkable(t) for t in frame.live]
        frame.stops = frame.last_op.stops()
        frame.live = None  # NOTE [backward inside the forward]


def _validate(fn: object) -> None:
    if not callable(fn) or (isinstance(fn, type) and issubclass(fn, nn.Module)):  # a class: made, not run
        rule, hint = "fn must be callable", "pass a function or an nn.Module, then its arguments"
        given = f"got the class {fn.__name__}" if isinstance(fn, type) else f"got {type(fn).__name__}"
        raise RematTypeError(message("checkpoint", rule, given, hint + " (an instance, not its class)"))


def checkpointed(module: nn.Module) -> bool:
    """Whether ``module``'s forward is a checkpointed region (``remat.checkpoint(module)``)."""
    return isinstance(module.__dict__.get("forward"), _Checkpointed)


class _Checkpointed:
    """A module's ``forward`` run as a checkpointed region (the module form). An object, not a
    closure: a copy of the module (``copy.deepcopy``, an EMA's ``AveragedModel``) gets a forward of
    its own, bound to the copy, where a closure would run the original's weights."""

    def __init__(self, forward: Callable[..., Any], settings: Settings) -> None:
        self.forward, self.settings = forward, settings
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        s = self.settings
        return run(self.forward, args, kwargs, s.policy, s.check, s.preserve_rng, s.offloader)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Checkpointed:
        return _Checkpointed(copy.deepcopy(self.forward, memo), self.settings)


def _wrap(fn: F, s: Settings) -> F:
    if isinstance(fn, nn.Module):
        fn.forward = _Checkpointed(fn.forward, s)  # type: ignore[method-assign]
        return fn

    @functools.wraps(fn)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return run(fn, args, kwargs, s.policy, s.check, s.preserve_rng, s.offloader)

    return checkpointed  # type: ignore[return-value]


@overload
def checkpoint(
    fn: F, /, *, policy: Policy | None = ..., check: Check = ..., offloader: Offloader | None = ...
) -> F: ...
@overload
def checkpoint(
    fn: None = ...,
    /,
    *,
    policy: Policy | None = ...,
    check: Check = ...,
    offloader: Offloader | None = ...,
    **torch_keywords: Any,
) -> Callable[[F], F]: ...
@overload
def checkpoint(
    fn: Callable[..., Any],
    /,
    *args: Any,
    policy: Policy | None = ...,
    check: Check = ...,
    offloader: Offloader | None = ...,
    **kwargs: Any,
) -> Any: ...


def checkpoint(
    fn: Any = None,
    /,
    *args: Any,
    policy: Policy | None = None,
    check: Check = "shapes",
    offloader: Offloader | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its inputs; recompute its insides in backward.

    Three forms:

    - ``y = remat.checkpoint(fn, x, mask=m)`` runs the call (``policy``, ``check`` and the keywords
      of ``torch.utils.checkpoint.checkpoint`` are remat's, see ``remat.manual.keywords``;
      everything else goes to ``fn``); outputs the policy decides ``Decision.OFFLOAD`` wait in
      host memory through ``offloader`` (a ``remat.Offloader``; a default one if None);
    - ``@remat.checkpoint`` or ``@remat.checkpoint(policy=...)`` decorates a function;
    - ``remat.checkpoint(module)`` wraps an ``nn.Module``'s forward in place and returns the module
      (its ``state_dict`` keys do not change).

    A call with no arguments returns the decorated form: write ``remat.checkpoint(fn)()`` to run a
    function that takes none, or pass one of torch's keywords (``remat.checkpoint(fn,
    use_reentrant=False)`` runs ``fn()``, as torch's does). Under ``torch.no_grad()`` or inference
    mode the function simply runs.
    """
    torch_kwargs, kwargs = keywords.split(kwargs)
    if fn is None:
        if args or kwargs:
            _validate(fn)  # raises: None is no function
        s = keywords.settings("checkpoint", torch_kwargs, policy, check, offloader)

        def decorate(f: F) -> F:
            _validate(f)
            return _wrap(f, s)

        return decorate
    _validate(fn)
    s = keywords.settings("checkpoint", torch_kwargs, policy, check, offloader)
    if not args and not kwargs and not torch_kwargs:
        return _wrap(fn, s)
    return run(fn, args, kwargs, s.policy, s.check, s.preserve_rng, s.offloader)
