"""The program's own generators a checkpointed call may draw from, whose states its recomputation
must start from as the default generators' do.

NOTE [own generators] A random op given ``generator=g`` draws from ``g``, not from the default
generator of its device, so restoring the defaults' states (as ``torch.utils.checkpoint`` does)
leaves such a recomputation drawing the next numbers of ``g``: a dropout-like mask of its own comes
out different and the gradients are silently wrong. ``remat.checkpoint`` finds the generators the
call can reach without running it: those among its arguments (in lists, tuples and dicts), in the
closure of the function or named as globals by its code or by the functions it reaches that way,
as attributes of the object a method is bound to (``remat.manual.reach``), in a partial's
arguments, and held as attributes by the modules the call is known to run
(``remat.manual.buffers.region_modules``); lists, tuples and dicts of at most ``CONTAINER_LIMIT``
items are searched. Their states are taken before the forward and set for the recomputation, and
the program's streams given back after it. A generator reached otherwise (an attribute of an
argument that is not a module) is not found.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from remat._modules import own_attributes
from remat.manual.reach import CONTAINER_LIMIT, held

__all__ = ["generators_in", "own_generators"]


def own_generators(
    fn: Any,
    args: Iterable[Any],
    kwargs: Mapping[str, Any],
    modules: Iterable[nn.Module],
    reach: Sequence[Any] | None = None,
) -> list[torch.Generator]:
    """The generators ``fn(*args, **kwargs)`` can reach (NOTE [own generators]), each once;
    ``reach``: ``held(fn)`` where the caller has it."""
    values: list[Any] = [*args, *kwargs.values()]
    if isinstance(fn, functools.partial):  # what it holds is its function's, not its own
        values += [*fn.args, *fn.keywords.values(), *held(fn.func)]
    else:
        values += held(fn) if reach is None else reach
    for module in modules:
        values += [v for _, v in own_attributes(module)]
    return generators_in(values)


def generators_in(values: Iterable[Any]) -> list[torch.Generator]:
    """The generators among ``values`` and in those of them that are lists, tuples and dicts of at
    most ``CONTAINER_LIMIT`` items, each once."""
    found: dict[int, torch.Generator] = {}
    for value in values:
        items = value.values() if isinstance(value, dict) else value
        container = isinstance(value, (dict, list, tuple)) and len(value) <= CONTAINER_LIMIT
        for item in items if container else [value]:
            if type(item) is torch.Generator:
                found.setdefault(id(item), item)
    return list(found.values())
