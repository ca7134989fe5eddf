"""The inputs of a call that runs again in backward (``remat.checkpoint``, a plan's module run
again): held through autograd's saved-tensor machinery, and handed to the recomputation as they
were when the call ran.

Every tensor of the call's arguments is held, at any depth of the lists, tuples, dicts and other
containers torch's pytree knows (``f([a, b])``, ``f(batch={"x": x})``): autograd then refuses
one written in place since (its version check), where a tensor read through a list by reference
would silently give the recomputation its new values. Holding them through autograd
(``SaveInputs``) also lets an enclosing checkpoint see them, so nested checkpoints drop and
recompute them as well. The containers are made anew for the recomputation from what they held at
the call; other values (numbers, modules, objects pytree does not know) are passed as they are.

An inference tensor (made under ``torch.inference_mode``) cannot be saved for backward and has no
version counter; no op outside inference mode can write it, so it is passed as it is.

The call also reads what it is not given: its modules' parameters and plain tensor attributes, and
the tensors its closure, default arguments and globals hold (``remat.manual.reach``). Autograd keeps
only those a backward needs (a first layer's weight is not saved where its input needs no
gradient), so one written in place between the forward and the backward (an optimizer's step for
another loss, a max-norm renorm) passes the plain step, which reads the forward's activations, and a
recomputation would compute other values from it: ``Unwritten`` notes their versions when the call
ends and refuses a recomputation from one written since. A module attribute may also hold another
tensor by then (``torch.func.functional_call`` put its own in for the forward and took them out;
``layer.weight = nn.Parameter(...)``): the recomputation runs with the forward's tensors put back
(``Unwritten.restored``), as long as they live. An attribute the call itself set (a weight norm's
pre-hook computes ``weight`` at every call; ``self.attn_map = a.detach()``) is the call's own
output, which its recomputation sets again: it is not put back. One whose tensor is gone is taken
away while the recomputation runs, which is refused if it reads it: a closure over a whole model
reaches every block's attributes, and a block that does not run in this call does not read its own.

Objects pytree does not know (a dataclass batch, a ``SimpleNamespace``) are passed as they are, so
the recomputation reads their tensors by reference: ``carried`` finds those (``CARRIED_DEPTH``
attributes deep) for ``Unwritten``'s version check, which refuses one written in place since.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from remat._errors import RecomputationError, message
from remat._leaves import flat
from remat._modules import own_attributes
from remat.aten import describe
from remat.manual.reach import CONTAINER_LIMIT

__all__ = ["CARRIED_DEPTH", "Inputs", "SaveInputs", "Unwritten", "carried"]

CARRIED_DEPTH = 2  # attributes followed from an argument pytree passed as it is


class SaveInputs(torch.autograd.Function):
    """Holds the call's tensor inputs through autograd's saved-tensor machinery (see the module
    doc); its output is an anchor no graph differentiates."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(*tensors)
        return anchor.detach()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - never part of a used graph
        raise RuntimeError("remat internal: SaveInputs is an anchor and is never differentiated")


class Inputs:
    """The arguments of one call, for running it again (``again``)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.spec: TreeSpec | None = None
        self.keys = tuple(kwargs)
        leaves = flat(args, kwargs)
        if leaves is None:  # containers: as pytree takes them apart
            leaves, self.spec = tree_flatten((tuple(args), dict(kwargs)))
        self.slots = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor) and not a.is_inference()]
        # one tensor given in several places (``attn(h, h, h)``) is one tensor again: a module may
        # take another path where its arguments are not the same object (``query is key``)
        first: dict[int, int] = {}
        self.which = [first.setdefault(id(leaves[i]), len(first)) for i in self.slots]
        tensors = list({id(leaves[i]): leaves[i] for i in self.slots}.values())
        self.requires_grad = [t.requires_grad for t in tensors]
        anchor = torch.empty((0,), requires_grad=True)
        self.saver = SaveInputs.apply(anchor, *tensors) if tensors else None
        for i in self.slots:  # held by the saver's node only: the call's inputs may die with it
            leaves[i] = None
        self.leaves = leaves

    def again(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments as they were at the call, each tensor detached and requiring grad as it
        did; raises autograd's RuntimeError where one was written in place since.

        NOTE [inputs cut] Detached, so that what the function does to its inputs when run again
        (a hook registered, a gradient retained) stays on copies, not on the program's tensors. A
        function that differentiates with respect to a tensor made before its inputs
        (``torch.autograd.grad(u, coords)`` with the input computed from ``coords``) finds no path
        there: torch's error is given back as ``failed_again``'s."""
        leaves = list(self.leaves)
        if self.saver is not None:
            saved = self.saver.grad_fn.saved_tensors  # type: ignore[union-attr]
            fresh = [t.detach().requires_grad_(g) for t, g in zip(saved, self.requires_grad, strict=True)]
            for slot, k in zip(self.slots, self.which, strict=True):
                leaves[slot] = fresh[k]
        if self.spec is None:
            cut = len(leaves) - len(self.keys)
            return tuple(leaves[:cut]), dict(zip(self.keys, leaves[cut:], strict=True))
        args, kwargs = tree_unflatten(leaves, self.spec)
        return tuple(args), dict(kwargs)


class Unwritten:
    """What a call reads besides its arguments (see the module doc): the parameters and plain tensor
    attributes of ``modules``, by module and name, and ``loose`` tensors, each at its version now."""

    def __init__(self, modules: Iterable[torch.nn.Module], loose: Iterable[Any] = ()) -> None:
        named = [(m, name) for m in modules for name in _tensor_names(m)]  # one walk of the modules
        self.places = [(weakref.ref(m), name) for m, name in named]
        self.start: list[Any] = [_attribute(m, name) for m, name in named]  # until the call ends
        found = {id(t): t for m, name in named if isinstance(t := _attribute(m, name), torch.Tensor)}
        found.update((id(t), t) for t in loose if isinstance(t, torch.Tensor) and id(t) not in found)
        live = [t for t in found.values() if not torch.nn.parameter.is_lazy(t) and not t.is_inference()]
        self.read = [(weakref.ref(t), t._version) for t in live]
        # per place, the tensor the call ended with (``_SET``: the call set the attribute itself)
        self.held: list[weakref.ref[torch.Tensor] | object | None] = []
        self.written: list[torch.Tensor] = []  # by the call itself: its recomputation would write them again

    def again(self) -> None:
        """Take the versions now (the call has ended), noting the tensors the call wrote and the
        tensor each module attribute holds."""
        now = [(ref, t, version) for ref, version in self.read if (t := ref()) is not None]
        self.written = [t for _, t, version in now if t._version != version]
        self.read = [(ref, t._version) for ref, t, _ in now]
        ends = [_attribute(m(), name) for m, name in self.places]
        self.held = [_SET if e is not s else _ref(e) for e, s in zip(ends, self.start, strict=True)]
        self.start = []

    @contextlib.contextmanager
    def restored(self, api: str) -> Iterator[None]:
        """The recomputation's block: each module attribute holding another tensor than when the
        call ended holds that one again, and is given back after. One whose tensor is gone is taken
        away for the block: a recomputation that reads it is refused (a closure over a whole model
        reaches attributes of blocks it does not run)."""
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        hidden: list[tuple[torch.nn.Module, str]] = []
        orders: list[tuple[dict[str, Any], list[str]]] = []
        try:
            for (module_ref, name), was in zip(self.places, self.held, strict=True):
                if was is _SET:  # the call's own output: its recomputation sets it again
                    continue
                module, then = module_ref(), was() if isinstance(was, weakref.ref) else None
                if module is None or _attribute(module, name) is then:
                    continue
                box: dict[str, Any] = module._parameters if name in module._parameters else module.__dict__
                swapped.append((box, name, box[name]))
                if then is None:
                    hidden.append((module, name))
                    orders.append((box, list(box)))  # a parameter put back keeps its place
                    del box[name]
                else:
                    box[name] = then
            yield
        except AttributeError as error:
            read = [
                f"{type(m).__name__}.{n}" for m, n in hidden if f"object has no attribute '{n}'" in str(error)
            ]
            if not read:
                raise
            rule = "a module attribute the function read holds another tensor since the forward, and the "
            rule += "forward's tensor is gone"
            hint = "replace it after backward, or run this function without recomputation"
            raise RecomputationError(message(api, rule, ", ".join(read), hint)) from None
        finally:
            for box, name, value in reversed(swapped):
                box[name] = value
            for box, order in orders:  # in their order again: one taken away went back last
                items = {k: box[k] for k in order if k in box} | box
                box.clear()
                box.update(items)

    def check(self, api: str) -> None:
        """Refuse to recompute where the call wrote one of them itself, or one was written since."""
        for t in self.written:
            raise RecomputationError(
                message(
                    api,
                    "the function writes in place a parameter or tensor it reads besides its "
                    "arguments (an embedding's max_norm renormalizes its weight), which its "
                    "recomputation would write again: other values",
                    f"{describe(t.dtype, t.shape)} written by the forward",
                    "leave the module that writes it out of the function, or use remat.scope",
                )
            )
        for ref, version in self.read:
            now = ref()
            if now is not None and now._version != version:
                raise RecomputationError(
                    message(
                        api,
                        "a parameter or tensor the function read by reference (not a tensor argument: "
                        "a module's, a closure's, or one an argument object such as a dataclass holds) was "
                        "modified in place before backward recomputed from it",
                        f"{describe(now.dtype, now.shape)} at version {now._version}, read at "
                        f"version {version}",
                        "modify it after backward (an optimizer's step), or run this function "
                        "without recomputation",
                    )
                )


def carried(values: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors in the attributes of ``values`` (objects pytree passes as they are: a dataclass, a
    ``SimpleNamespace``, a batch class of the program's own), and in the lists, tuples and dicts
    there, ``CARRIED_DEPTH`` attributes deep. Modules are not searched (their tensors are
    ``Unwritten``'s places), nor classes, functions, Python modules or containers larger than
    ``CONTAINER_LIMIT``."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = [(v, 0) for v in values]
    while todo:
        value, depth = todo.pop()
        if id(value) in seen or isinstance(value, _OPAQUE):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
        elif isinstance(value, (list, tuple, dict)):
            items = list(value.values()) if isinstance(value, dict) else list(value)
            if len(items) <= CONTAINER_LIMIT:
                todo += [(v, depth) for v in items]
        elif depth < CARRIED_DEPTH and isinstance(fields := getattr(value, "__dict__", None), dict):
            todo += [(v, depth + 1) for v in fields.values()] if len(fields) <= CONTAINER_LIMIT else []
    return list(found.values())


_OPAQUE = (torch.nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType, str, bytes)
_SET = object()  # ``Unwritten.held``: the call set this attribute itself


def _tensor_names(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s own parameters and plain tensor attributes (buffers apart: the
    buffer shield keeps what the forward saw of them, ``remat.manual.buffers``)."""
    names = [n for n, p in module._parameters.items() if p is not None]
    return names + [n for n, v in own_attributes(module) if isinstance(v, torch.Tensor)]


def _attribute(module: torch.nn.Module | None, name: str) -> Any:
    if module is None:
        return None
    return module._parameters[name] if name in module._parameters else vars(module).get(name)


def _ref(value: Any) -> weakref.ref[torch.Tensor] | None:
    return weakref.ref(value) if isinstance(value, torch.Tensor) else None


def failed_again(api: str, error: RuntimeError) -> RecomputationError:
    """torch's ``error`` in a function run again in backward, said as remat's (NOTE [inputs cut])."""
    return RecomputationError(
        message(
            api,
            "the function raised when run again in backward, where its inputs are detached from "
            "what made them (a torch.autograd.grad with respect to a tensor made before its inputs "
            "finds no path)",
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            "keep a function that differentiates with respect to earlier tensors out of the "
            "checkpoint, or make it run the same when called again",
        )
    )
