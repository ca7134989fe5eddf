"""A call's arguments as torch's pytree flattens them, without its walk where they are flat.

Why: pytree walks ``(args, kwargs)`` in a few microseconds per call, and its tree spec costs as
much again to hash and compare; the forms that read every call's arguments (a checkpointed call's
inputs, a plan's template lookup) pay that on every layer. A call whose arguments are all tensors,
numbers, strings or None (``layer(hidden_states, mask)``) has the leaves ``[*args,
*kwargs.values()]``, as pytree gives them (a dict's values in their order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["LEAF_TYPES", "flat", "leaves"]

# what pytree takes as a leaf, never as a container
LEAF_TYPES = frozenset({torch.Tensor, nn.Parameter, int, float, bool, str, type(None)})


def flat(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any] | None:
    """The leaves of a call whose arguments are all of ``LEAF_TYPES``; None for any other call."""
    found = [*args, *kwargs.values()]
    return found if all(type(a) in LEAF_TYPES for a in found) else None


def leaves(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """``tree_leaves((args, kwargs))``, without the walk where the call is ``flat``."""
    found = flat(args, kwargs)
    return tree_leaves((args, kwargs)) if found is None else found
