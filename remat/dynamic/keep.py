"""What a region's ``keep`` names: the modules, optimizers and tensors registered before its
first op, and the ones its undo snapshot covers (:mod:`remat.dynamic.undo`).

The gradients the kept modules' parameters and the kept tensors hold at the entry (left by
``zero_grad(set_to_none=False)``, accumulated into by the backward) are registered with them.

NOTE [arriving constants] A tensor from before the block that is neither in ``keep`` nor such a
gradient (a second input batch first read mid-step) holds memory from the block's start, but the
runtime learns of it only when an op first reads it, and the pool may be full by then. So each
block sets aside, beside the reserve, the bytes of the constants that arrived that way in the block
before (``arriving``; the pool gets the rest). The first block's arrivals are the reserve's to cover,
and it may not be enough: the budget is held from the next block on (in the arena from the first,
whose copies beside the arena are held against what the arrivals leave of the reserve, or it raises:
NOTE [beside the arena] in ``arena``). Naming such a tensor in ``keep`` holds it from the first.
One that arrives before any op made a tensor (the batch the first op reads) was never beside a
full pool, except in the arena, which holds its piece of the pool as a hole beside its own memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from remat._errors import RematTypeError, message
from remat.trace.types import TensorInfo

API = "dynamic"
"""The API name in the errors of ``remat.dynamic``."""


def members(keep: object) -> list[object]:
    """Every module, optimizer and tensor of ``keep`` (modules' parameters, buffers and gradients,
    optimizers' state tensors, in that order after their owner; a tensor's gradient after it), from
    (nested) sequences or mappings."""
    found: list[object] = []
    _visit(keep, found)
    return found


def arrived(tensors: Sequence[TensorInfo], outside: Iterable[int], entered: int, places: bool) -> int:
    """The bytes of the constants from before the block (handles ``outside``) that arrived beside
    memory the pool did not count (NOTE [arriving constants]): registered after the entry (the
    first ``entered`` handles) by a backend that ``places`` tensors, else once an op made one."""
    made = next((t.id for t in tensors if not t.constant), len(tensors))
    since = entered if places else made
    return sum(tensors[h].nbytes for h in outside if h >= since)


def _visit(item: object, found: list[object], state: bool = False) -> None:
    """Add what ``item`` holds to ``found`` (a function of the module, not a closure that refers to
    itself: that would be a reference cycle on every region's entry). Numbers pass in an optimizer's
    ``state`` only (step counts); in what the caller gives they are a mistake."""
    if isinstance(item, torch.Tensor):
        if is_lazy(item):  # a lazy module's parameter before its first forward: no memory yet
            return
        found.append(item)
        if item.is_leaf and item.grad is not None:
            found.append(item.grad)
    elif isinstance(item, nn.Module):
        found.append(item)
        found.extend(t for t in (*item.parameters(), *item.buffers()) if not is_lazy(t))
        found.extend(p.grad for p in item.parameters() if p.grad is not None)
    elif isinstance(item, torch.optim.Optimizer):
        found.append(item)
        for kept in item.state.values():
            _visit(list(kept.values()), found, state=True)
    elif isinstance(item, Mapping):
        for value in item.values():
            _visit(value, found, state)
    elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
        for value in item:
            _visit(value, found, state)
    elif item is not None and not (state and isinstance(item, (int, float, bool))):
        raise RematTypeError(
            message(
                API,
                "keep takes modules, optimizers, tensors and collections of them",
                f"got {type(item).__name__}",
                "pass e.g. keep=(model, optimizer)",
            )
        )
