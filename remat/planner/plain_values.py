"""The plain values a region module's code may branch on or compute with: the part of a taped
call's setting that its modules hold (NOTE [taped call run bare] in ``remat.planner.taped_calls``).

Read at every call of a region's module run bare, so kept to what can hold such a value: each
module's own attributes but the dicts and the set torch keeps on every module (its parameters,
buffers, children and hooks), the attributes of a plain object a module holds (a config), and the
globals the modules' ``forward`` names.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn

from remat._modules import TORCH_DICTS, below
from remat.trace.recorder import CALL_VALUES

__all__ = ["plain_values"]


def plain_values(module: nn.Module) -> tuple[Hashable, ...]:
    """The plain values (``CALL_VALUES`` but tensors) the region's code may branch on or compute
    with, beside the forward's setting: each of its modules' own, those of a plain object a module
    holds (a config, read once however many modules hold it), and the globals its modules'
    ``forward`` names."""
    values: list[Hashable] = []
    read: set[int] = set()
    for m in below(module):
        for name, v in vars(m).items():
            if name in TORCH_DICTS:
                continue
            if _plain(v):
                values.append((name, v))
            elif (
                id(v) not in read
                and type(v) not in _NOT_OBJECTS
                and isinstance(getattr(v, "__dict__", None), dict)
            ):
                read.add(id(v))
                if not isinstance(v, (nn.Module, torch.Tensor)):
                    values += [(name, key, w) for key, w in vars(v).items() if _plain(w)]
        forward = type(m).forward
        code, names = getattr(forward, "__code__", None), getattr(forward, "__globals__", {})
        if code is not None:
            values += [(name, names[name]) for name in code.co_names if name in names and _plain(names[name])]
    return tuple(values)


_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device})
_NOT_OBJECTS = frozenset({dict, list, tuple, set, type(None)})  # containers: not read


def _plain(v: object) -> bool:
    kind = type(v)
    return kind in _PLAIN or (
        kind not in _NOT_OBJECTS and isinstance(v, CALL_VALUES) and not isinstance(v, torch.Tensor)
    )
