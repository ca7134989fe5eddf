"""What a region's program wants at its end, told to the core as soon as it exists: the gradients
of the leaves the region counts: those in ``keep``, and every other one an op reads as the engine
registers its storage (the first read on each storage; for a view of a leaf, ``t(weight)``, its
base's).

The program holds a parameter's ``.grad`` until after the region, so the hand-over (NOTE
[hand-over] in :mod:`remat.dynamic.engine`) needs it resident. A policy sees only a storage made
early in the backward and never read again in the region, the stalest of all, and evicts it; the
hand-over then re-runs the backward chain that made it. A hook after each accumulation of such a
leaf's gradient marks the gradient's storage wanted at the end (NOTE [wanted at the end] in
:mod:`remat.core.residency`): the core evicts it only when nothing else can make room.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch.utils.hooks import RemovableHandle


def watch(
    members: Iterable[object], wanted: Callable[[torch.Tensor], None], watched: set[int]
) -> list[RemovableHandle]:
    """Call ``wanted(t.grad)`` after each accumulation of the gradient of every leaf tensor ``t``
    among ``members`` (or, for a view of a leaf, ``t(weight)`` as an op reads it, of its base) that
    requires one and is not in ``watched`` (ids: each once), which it joins. Returns the hooks, to
    remove when the region ends."""
    hook = partial(_accumulated, wanted)
    hooks = []
    for t in members:
        if isinstance(t, torch.Tensor) and not t.is_leaf and t._base is not None:
            t = t._base
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf and id(t) not in watched:
            watched.add(id(t))
            hooks.append(t.register_post_accumulate_grad_hook(hook))
    return hooks


def _accumulated(wanted: Callable[[torch.Tensor], None], leaf: torch.Tensor) -> None:
    if leaf.grad is not None and leaf.grad.layout == torch.strided:  # a sparse one: not the pool's
        wanted(leaf.grad)
