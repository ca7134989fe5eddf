"""A model's modules, parameters and buffers in the order ``nn.Module``'s own walks give them, each
once, without the generators and the names those walks build; and what of a module's attributes
torch keeps for itself.

Why: a plan reads them at every forward (the setting of a bare forward, the parameters that
require grad, a region module's plain values); ``model.parameters()`` builds every module's
dotted name on the way, which costs tens of microseconds on a small stage run once per
micro-batch of a pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["TORCH_DICTS", "TORCH_FIELDS", "below", "buffers", "own_attributes", "parameters"]

T = TypeVar("T", bound=torch.Tensor)

_BARE = vars(nn.Module())
# what every module holds for torch itself: its parameters, buffers and children (each in a dict of
# its own), its hooks, and its flags (``training``); never a tensor attribute or a generator of the
# program's
TORCH_FIELDS = frozenset(_BARE)
# of those, the dicts and the set: no plain value of the module's is in them
TORCH_DICTS = frozenset(k for k, v in _BARE.items() if isinstance(v, (dict, set)))


def own_attributes(module: nn.Module) -> list[tuple[str, Any]]:
    """The attributes ``module`` holds in its ``__dict__`` besides ``TORCH_FIELDS``."""
    return [(k, v) for k, v in vars(module).items() if k not in TORCH_FIELDS]


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


def parameters(module: nn.Module, modules: Sequence[nn.Module] | None = None) -> list[nn.Parameter]:
    """``list(module.parameters())``: by module in ``below``'s order (``modules``: ``below(module)``
    where the caller has it), each parameter once."""
    walked = below(module) if modules is None else modules
    return _once(p for m in walked for p in m._parameters.values() if p is not None)


def buffers(module: nn.Module, modules: Sequence[nn.Module] | None = None) -> list[torch.Tensor]:
    """``list(module.buffers())``: as ``parameters``, of the buffers."""
    walked = below(module) if modules is None else modules
    return _once(b for m in walked for b in m._buffers.values() if b is not None)


def _once(tensors: Iterable[T]) -> list[T]:
    seen: set[int] = set()
    out: list[T] = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
