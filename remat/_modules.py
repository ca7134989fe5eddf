"""A model's modules, parameters and buffers in the order ``nn.Module``'s own walks give them, each
once, without the generators and the names those walks build.

Why: a plan reads them at every forward (the setting of a bare forward, the parameters that
require grad, a region module's plain values); ``model.parameters()`` builds every module's
dotted name on the way, which costs tens of microseconds on a small stage run once per
micro-batch of a pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import torch
from torch import nn

__all__ = ["below", "buffers", "parameters"]

T = TypeVar("T", bound=torch.Tensor)


def below(module: nn.Module) -> list[nn.Module]:
    """``list(module.modules())``: depth first, each module once."""
    seen: set[int] = set()
    found: list[nn.Module] = []
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        found.append(m)
        stack += [c for c in reversed(m._modules.values()) if c is not None]
    return found


def parameters(module: nn.Module) -> list[nn.Parameter]:
    """``list(module.parameters())``: by module in ``below``'s order, each parameter once."""
    return _once(p for m in below(module) for p in m._parameters.values() if p is not None)


def buffers(module: nn.Module) -> list[torch.Tensor]:
    """``list(module.buffers())``: by module in ``below``'s order, each buffer once."""
    return _once(b for m in below(module) for b in m._buffers.values() if b is not None)


def _once(tensors: Iterable[T]) -> list[T]:
    seen: set[int] = set()
    out: list[T] = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
