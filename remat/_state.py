"""Work that runs a model and leaves it as it was: its buffers, its parameters' gradients and the
CPU generator put back afterwards (tracing a step, profiling a chain, planning a pipeline), and
the gradients of every other leaf its backward reaches (an input, a loss head's weights)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn


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
    values back (batch norm's statistics), their parameters their ``.grad`` and the CPU generator
    its state (dropout's draws); so do the ``.grad`` of the tensors ``leaves`` notes inside."""
    found = list(modules)
    buffers = [(b, b.detach().clone()) for m in found for b in m.buffers()]
    grads = [(p, p.grad) for m in found for p in m.parameters()]
    for p, _ in grads:  # backward inside adds into an existing ``.grad`` in place: start from none
        p.grad = None
    rng = torch.random.get_rng_state()
    try:
        yield
    finally:
        for t, g in leaves.grads.values() if leaves is not None else ():
            t.grad = g
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for p, g in grads:
            p.grad = g
        torch.random.set_rng_state(rng)
