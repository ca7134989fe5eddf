"""Work that runs a model and leaves it as it was: its buffers, its parameters' gradients and the
generators put back afterwards (tracing a step, profiling a chain, planning a pipeline), the
gradients of every other leaf its backward reaches (an input, a loss head's weights), and the
parameters its ops write in place (``ParametersBack``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from remat import aten
from remat._dispatch import Unguarded
from remat._modules import own_attributes
from remat.manual.own_generators import generators_in


class Leaves:
    """The leaves backward accumulates into, noted before each backward (``note``) with their
    ``.grad`` then; ``untouched`` gives the first noted ``.grad`` back."""

    def __init__(self) -> None:
        self.grads: dict[int, tuple[torch.Tensor, Any]] = {}

    def note(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss``, its graph's leaves noted (a walk of its nodes: no op runs)."""
        seen: set[Any] = set()
        stack = [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)
            if isinstance(leaf, torch.Tensor):
                # backward adds into an existing ``.grad`` in place: the one given back must not be
                # it, in this block or in another noted by the same ``Leaves`` after it
                self.grads.setdefault(id(leaf), (leaf, leaf.grad))
                leaf.grad = None
            stack.extend(n for n, _ in node.next_functions)
        return loss


@contextlib.contextmanager
def untouched(modules: Iterable[nn.Module], leaves: Leaves | None = None) -> Iterator[None]:
    """Inside, run ``modules`` at will; on the way out (an error included) their buffers get their
    values back (batch norm's statistics) and each buffer name its tensor (one the forward bound
    anew), their parameters their ``.grad``, and the default generators of the CPU and every
    initialized accelerator and the generators the modules (and those below them) hold as
    attributes (``self.g``, alone or in a list, tuple or dict) their states (dropout's draws); so
    do the ``.grad`` of the tensors ``leaves`` notes inside."""
    found = list(modules)
    buffers = [(b, b.detach().clone()) for m in found for b in m.buffers()]
    # which tensor each module's buffer names: a forward may bind a new one (``self.pe =
    # self.pe.to(x.dtype)``, a running average ``self.ema = 0.9 * self.ema + ...``)
    every = list({id(m): m for f in found for m in f.modules()}.values())  # each module below once
    bound = [(m, dict(m._buffers)) for m in every]
    grads = [(p, p.grad) for m in found for p in m.parameters()]
    for p, _ in grads:  # backward inside adds into an existing ``.grad`` in place: start from none
        p.grad = None
    rng = aten.capture_all(generators_in(v for m in every for _, v in own_attributes(m)))
    try:
        yield
    finally:
        for t, g in leaves.grads.values() if leaves is not None else ():
            t.grad = g
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for m, names in bound:
            now, built = m._buffers, _built(m, names)
            if len(now) != len(names) or any(now.get(k) is not t for k, t in {**names, **built}.items()):
                m._buffers.clear()
                m._buffers.update({**names, **built})
        for p, g in grads:
            p.grad = g
        aten.restore(rng)


def _built(module: nn.Module, names: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """NOTE [built at first call] A module may build a table at its first call and keep it for the
    next ones (``if self.pe is None: self.pe = ...``, a rotary or positional cache): the first call
    runs other ops than the later ones. Put back unbuilt, it made planning trace the building call
    while training runs the others (a plan refused the second step; a plain attribute, which is not
    put back, the first). So a buffer of ``module`` that was None, is not saved in its state dict
    (``persistent=False``) and holds a tensor now is left holding it."""
    kept = module._non_persistent_buffers_set
    now = module._buffers
    return {k: t for k, t in now.items() if k in kept and names.get(k, 0) is None and t is not None}


class ParametersBack(Unguarded):
    """A dispatch mode under which each parameter of ``modules`` that an op writes in place (an
    embedding's ``max_norm`` renormalizes its weight's rows in forward), and each of ``tensors``
    (the step's inputs: a model whose first op writes its input), has its content copied just
    before the first such write; ``restore`` writes it back. The copy runs outside every dispatch
    mode (a capture's recorder below this one does not see it). Planning runs the step several
    times: without this, each run left the weight renormalized again, and the trained model was
    not the one given; a batch the model adds to in place came back with three additions. So
    each generator a random op is handed has its state taken before its first draw, and put back."""

    def __init__(self, modules: Iterable[nn.Module], tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        made: list[torch.Tensor] = [p for m in modules for p in m.parameters() if not nn.parameter.is_lazy(p)]
        made += tensors
        found = {id(p): p for p in made if p.layout == torch.strided}
        self.params = {p.untyped_storage()._cdata: p for p in found.values()}
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the generators random ops are handed (``generator=self.config.g``, wherever the model keeps
        # it), with their states before their first draw: ``untouched`` reaches only those a module
        # holds as its own attributes
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        facts = aten.facts(func)
        for g in (v for v in (*args, *kwargs.values()) if type(v) is torch.Generator) if facts.random else ():
            self.generators.setdefault(id(g), (g, g.get_state()))
        places = facts.all_writes(args) if facts.hidden_writes else facts.writes
        for t in aten.written_tensors(places, args, kwargs) if places and self.params else ():
            key = t.untyped_storage()._cdata if t.layout == torch.strided else -1
            if key in self.params and key not in self.copies:
                with _disable_current_modes():
                    self.copies[key] = (self.params[key], self.params[key].detach().clone())
        return func(*args, **kwargs)

    def restore(self) -> None:
        with torch.no_grad():
            for p, content in self.copies.values():
                p.copy_(content)
        self.copies.clear()
        for g, state in self.generators.values():
            g.set_state(state)
        self.generators.clear()
