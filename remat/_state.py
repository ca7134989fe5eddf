"""Work that runs a model and leaves it as it was: its buffers, its parameters' gradients and the
CPU generator put back afterwards (tracing a step, profiling a chain, planning a pipeline)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn


@contextlib.contextmanager
def untouched(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Inside, run ``modules`` at will; on the way out (an error included) their buffers get their
    values back (batch norm's statistics), their parameters their ``.grad`` and the CPU generator
    its state (dropout's draws)."""
    found = list(modules)
    buffers = [(b, b.detach().clone()) for m in found for b in m.buffers()]
    grads = [(p, p.grad) for m in found for p in m.parameters()]
    rng = torch.random.get_rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for p, g in grads:
            p.grad = g
        torch.random.set_rng_state(rng)
