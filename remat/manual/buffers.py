"""Keeping module buffers untouched while a region is recomputed, and recomputing it from the
buffers' values of its forward.

Re-running a region in backward re-runs its modules' forward, and a module in training mode
updates its buffers as a side effect: batch norm's running mean and variance and
``num_batches_tracked`` would move twice per step (an open PyTorch bug). While a recomputation
runs, every module that starts a forward has its buffers swapped for private copies; the copies
take the update and are dropped afterwards, and the real buffers are put back untouched (their
version counters included, so tensors autograd saved from them stay valid). A module whose
``forward`` the recomputation calls itself (``remat.checkpoint(module)`` wraps the bound method, so
no ``__call__`` and no pre-hook runs for it) is named as a root and swapped at once.

NOTE [buffers as the forward saw them] By the time of the recomputation the forward has already
updated its buffers, so a private copy of the buffer as it is now is not what the forward read: a
module whose output depends on a buffer it updates (an exponential moving average used in training)
would compute otherwise, and the values check (``check="values"``) would see batch norm's running
statistics differ from those autograd saved. So where the region is a module (or its bound
``forward``), the buffers of up to ``COPY_LIMIT`` bytes of it and of every module below it are
copied before the forward, and a copy is kept where the forward then wrote the buffer: its version
moved, the module holds another tensor under the name (``self.avg = 0.9 * self.avg + ...``), or it
is batch norm's running statistics, which its kernel writes without moving their version (NOTE
[hidden writes] in ``remat.aten.schema``). The recomputation's private copies start from those, and
a buffer the forward did not write is not copied at all (a causal mask). The same holds for the
modules a function's closure holds (``create_custom_forward(layer)``) or its code names as
globals, those of the functions it reaches that way (``remat.manual.reach``), and the modules
the call is given as arguments, where their buffers come to ``COPY_LIMIT`` bytes at most (a
closure holding a whole model to run one layer is not copied), and a list of modules given to a
partial. A larger buffer is not copied; one written in the forward is recomputed from its new
value, as is any buffer of a module the region reaches otherwise (an attribute of an argument that
is not a module, a module held by an object in a global), and a module the region calls twice
reads, when recomputed, its buffers as they were before the first call. No module hook is added in
the forward: ``torch.compile`` guards on the global hooks, and a new one at every call would
compile the function again each time.

NOTE [compiled regions] A region that is a ``torch.compile``d module or function runs its modules
inside the compiled graph, which calls no forward pre-hook: found through the original it wraps,
every one of its modules is a root, its buffers swapped for the copies before the recomputation
starts (the graph reads a module's buffers when it runs). Before, the recomputation updated batch
norm's statistics a second time and read buffers the forward had written: other gradients.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from remat._dispatch import no_modes
from remat.manual.reach import CONTAINER_LIMIT, held

__all__ = ["COPY_LIMIT", "Buffers", "reached"]

COPY_LIMIT = 1 << 20  # bytes: the largest buffer copied before a forward (NOTE [buffers as ...])


def _hidden(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward writes buffer ``name`` without moving its version: batch norm's
    running statistics in training, which ``native_batch_norm`` writes (NOTE [hidden writes])."""
    norm = isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
    return norm and module.training and name in ("running_mean", "running_var")


def region_modules(
    fn: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    reach: Sequence[Any] | None = None,
) -> tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]]:
    """The modules a region running ``fn(*args, **kwargs)`` is known to run (a module, a module's
    bound method, a partial of a method and its module, or of a function and a list of modules: a
    segment of ``checkpoint_sequential``; the modules or lists of modules a function's closure
    holds, ``create_custom_forward(layer)``, or that the call is given; and the modules below them),
    and those whose forward its recomputation calls itself, which no pre-hook shields. ``reach``:
    ``held(fn)`` where the caller has it."""
    known, roots = _called(fn)
    reached = [*_closure(fn, reach), *(m for a in [*args, *(kwargs or {}).values()] for m in _modules_in(a))]
    # a closure or an argument may hold a whole model to run one of its layers (``lambda h:
    # self.blocks[i](h)``): each module reached is taken, with those below it, only where their
    # buffers are small enough to copy at every call (a large one leaves the others taken)
    seen = {id(m) for m in known}
    more: list[nn.Module] = []
    for top in reached:
        below = [m for m in top.modules() if id(m) not in seen]
        if sum(b.nbytes for m in below for b in m._buffers.values() if b is not None) <= COPY_LIMIT:
            more += below
            seen.update(id(m) for m in below)
    return (*known, *more), roots


def reached(fn: Any, values: Sequence[Any] = ()) -> tuple[nn.Module, ...]:
    """The modules ``fn`` is or is bound to, those its closure holds or its code names as globals
    (``_closure``), and those among ``values``, with every module below them (a loss function's
    head, for ``remat.plan``'s capture)."""
    return _below([*_called(fn)[0], *_closure(fn), *(m for v in values for m in _modules_in(v))])


def _called(fn: Any) -> tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]]:
    """The modules ``fn`` itself is or is bound to (see ``region_modules``), and its roots."""
    if isinstance(fn, nn.Module) and "_orig_mod" not in fn._modules:  # no compiled module's wrapper
        return tuple(fn.modules()), ()
    original = fn._orig_mod if isinstance(getattr(fn, "_orig_mod", None), nn.Module) else fn
    while callable(getattr(original, "_torchdynamo_orig_callable", None)):
        original = original._torchdynamo_orig_callable
    if original is not fn:  # NOTE [compiled regions]: every module is a root
        found = _below([*_called(original)[0], *_closure(original)])
        return found, found
    owner = getattr(fn, "__self__", None)
    if isinstance(fn, functools.partial) and fn.args:
        first = fn.args[0]
        if isinstance(first, nn.Module):
            owner = first  # ``partial(Layer.forward, layer, ...)``: transformers' layers
        elif _modules_in(first):
            return _below(_modules_in(first)), ()
    if isinstance(owner, nn.Module):
        return tuple(owner.modules()), (owner,)
    if isinstance(fn, nn.Module):
        return tuple(fn.modules()), ()
    return (), ()


def _closure(fn: Any, reach: Sequence[Any] | None = None) -> list[nn.Module]:
    """The modules, alone or in lists, that ``fn`` reaches without running (``remat.manual.reach``:
    its closure, the globals its code names, and those of the functions it names; ``reach``:
    ``held(fn)`` where the caller has it)."""
    return [m for value in (held(fn) if reach is None else reach) for m in _modules_in(value)]


def _modules_in(value: Any) -> list[nn.Module]:
    """``value`` if it is a module, its items if it is a list or tuple of modules (its values, for a
    dict) of at most ``CONTAINER_LIMIT`` items, else none."""
    if isinstance(value, nn.Module):
        return [value]
    if isinstance(value, dict) and len(value) <= CONTAINER_LIMIT:
        value = list(value.values())
    if (
        isinstance(value, (list, tuple))
        and 0 < len(value) <= CONTAINER_LIMIT
        and all(isinstance(m, nn.Module) for m in value)
    ):
        return list(value)
    return []


def _below(modules: list[nn.Module]) -> tuple[nn.Module, ...]:
    """``modules`` and every module below them, each once."""
    return tuple({id(m): m for top in modules for m in top.modules()}.values())


class Buffers:
    """The buffers of one region: those its forward wrote, as they were before (``noting``), and
    the shield of its recomputation (``shielded``). ``modules``: the modules of the region known
    before it runs (a module and those below it); ``roots``: modules whose forward the region
    calls without ``__call__``."""

    def __init__(self, modules: tuple[nn.Module, ...] = (), roots: tuple[nn.Module, ...] = ()) -> None:
        self.modules, self.roots = modules, roots
        self.before: dict[tuple[int, str], torch.Tensor] = {}  # (id(module), name) -> value before
        self.written: set[tuple[int, str]] = set()  # what the forward wrote: the buffers to shield
        self.moved: set[int] = set()  # modules with a buffer the forward was seen to write
        self.seen = {id(m) for m in modules if m._buffers}  # modules whose writes are known

    @contextlib.contextmanager
    def noting(self) -> Iterator[None]:
        """Around the region's forward (NOTE [buffers as the forward saw them])."""
        with no_modes():  # our copies are not the program's ops
            noted = [
                (m, name, buf, buf._version, buf.detach().clone() if buf.nbytes <= COPY_LIMIT else None)
                for m in self.modules
                for name, buf in m._buffers.items()
                if buf is not None
            ]
        yield
        for module, name, buf, version, copy in noted:
            seen = module._buffers.get(name) is not buf or buf._version != version
            if seen or _hidden(module, name):  # batch norm's statistics: hidden, maybe not run
                self.written.add((id(module), name))
                if seen:
                    self.moved.add(id(module))
                if copy is not None:
                    self.before[(id(module), name)] = copy

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """Within the block, buffer updates by any module's forward, by the roots, and to the
        buffers the forward wrote go to throwaway copies, which start from the values the region's
        forward read; of a module whose writes the forward noted, only the buffers it wrote are
        copied. The hook is the process's, but only this thread's module calls are the
        recomputation's: another thread's forward running meanwhile (a model trained beside this
        one) updates its buffers as usual."""
        swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
        done: set[int] = set()
        owner = threading.get_ident()

        def swap(module: nn.Module, _args: Any) -> None:
            if id(module) in done or not module._buffers or threading.get_ident() != owner:
                return
            done.add(id(module))
            # The copies are not the program's ops: a selective recomputation matches the ops it
            # runs to the forward's by position, so they must not reach its dispatch mode.
            with no_modes():
                for name, buf in module._buffers.items():
                    key = (id(module), name)
                    if buf is not None and (id(module) not in self.seen or key in self.written):
                        swapped.append((module, name, buf))
                        module._buffers[name] = self.before.get(key, buf).detach().clone()

        handle = nn.modules.module.register_module_forward_pre_hook(swap)
        try:
            # the roots, and every module the forward was seen to write a buffer of, at once: code
            # may write a module's buffers without calling its forward (``self.ema.mul_(...)``)
            for module in (*self.roots, *(m for m in self.modules if id(m) in self.moved)):
                swap(module, ())
            yield
        finally:
            handle.remove()
            for module, name, buf in reversed(swapped):
                module._buffers[name] = buf
