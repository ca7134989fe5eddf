"""An op's results sized before it runs (NOTE [room first] in ``remat.dynamic.engine``): by its
meta kernel, or, where their size depends on the data, by the most its arguments' sizes allow.

NOTE [bounded ops] No meta kernel sizes ``nonzero``, ``masked_select`` or ``x[mask]``: how many
elements come out depends on the data. Run before they are placed, they are the reserve's to cover
(NOTE [room first] in ``remat.dynamic.engine``), and a large one passes the budget by what the
reserve lacks. But each has a bound its arguments' sizes give (every element selected), and a
result never larger than it: the core places that bound before the op runs, as it places any
sized result, so the budget holds whatever the data. The pool counts the bound until the result is
released, more than the allocator holds (on the safe side; a region's ``stats.peak_bytes`` counts
it too); a recomputation makes the size the first run made (``AccountingBackend`` checks it
against that run, not against the bound). A bound can be far larger than what comes out
(``nonzero``'s: 8 bytes per input element and dimension): where it does not fit beside what the
pool cannot evict (``room_for``), the op runs first as before, its results the reserve's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from remat.dynamic.homes import aligned
from remat.dynamic.recipe import result_leaves

__all__ = ["BOUNDED", "bound", "depends_on_data", "meta", "meta_results", "room_for"]

_MASKS = (torch.bool, torch.uint8)


def _meta(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _nonzero(x: torch.Tensor) -> list[torch.Tensor]:
    return [_meta((x.numel(), x.dim()), torch.int64)]


def _masked_select(x: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [_meta((torch.broadcast_shapes(x.shape, mask.shape).numel(),), x.dtype)]


def _index(x: torch.Tensor, indices: Sequence[torch.Tensor | None]) -> list[torch.Tensor] | None:
    """``x[..., mask]``: one boolean mask over consecutive dimensions, the others taken whole."""
    masks = [(k, i) for k, i in enumerate(indices) if i is not None]
    if len(masks) != 1 or masks[0][1].dtype not in _MASKS:
        return None
    k, mask = masks[0]
    if tuple(x.shape[k : k + mask.dim()]) != tuple(mask.shape):
        return None
    return [_meta((*x.shape[:k], mask.numel(), *x.shape[k + mask.dim() :]), x.dtype)]


def depends_on_data(func: Any, args: Sequence[Any]) -> bool:
    """Whether ``func``'s results' sizes may depend on its arguments' values (``nonzero``, ``x[mask]``)."""
    if torch.Tag.dynamic_output_shape in func.tags:
        return True
    if func._schema.name != "aten::index" or len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in _MASKS for i in args[1])


BOUNDED = frozenset({"aten::nonzero", "aten::masked_select", "aten::index"})
"""The ops ``bound`` may size (by schema name), whose first run may make less than it placed."""


def bound(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor] | None:
    """Meta tensors as large as ``func``'s results can be, on the region's arguments; None where
    no rule here bounds them (then the op runs before it is placed, as before)."""
    if kwargs or not args or not isinstance(args[0], torch.Tensor) or args[0].layout != torch.strided:
        return None
    name = func._schema.name
    try:  # arguments the op itself refuses (shapes that do not broadcast) are the op's to name
        if name == "aten::nonzero" and func._overloadname == "default" and len(args) == 1:
            return _nonzero(args[0])
        if name == "aten::masked_select" and len(args) == 2 and isinstance(args[1], torch.Tensor):
            return _masked_select(args[0], args[1])
        if name == "aten::index" and func._overloadname == "Tensor" and len(args) == 2:
            return _index(args[0], args[1])
    except (RuntimeError, TypeError, ValueError):
        return None
    return None


def room_for(runtime: Any, metas: Sequence[torch.Tensor], args: Any) -> bool:
    """Whether ``metas`` (a bound) fit in ``runtime``'s pool beside what it cannot evict and the
    op's inputs, which it locks; where not, the op runs first, its results the reserve's."""
    n = len(runtime.graph)
    evictable = int(runtime.graph.nbytes_array[:n][runtime.evictable.array[:n]].sum())
    tensors = [t for t in [*tree_leaves(args), *metas] if isinstance(t, torch.Tensor)]
    need = sum(aligned(t.untyped_storage().nbytes()) for t in tensors)
    return bool(runtime.pool.used - evictable + need <= runtime.pool.capacity)


def meta_results(
    func: Any, args: Any, kwargs: Any, fresh_returns: tuple[bool, ...]
) -> list[torch.Tensor | None] | None:
    """``func``'s results on meta tensors, flat (None: not returned); None where no meta kernel tells."""
    kwargs = tree_map(meta, dict(kwargs))
    if not any(isinstance(x, torch.Tensor) for x in tree_leaves(args)):  # a factory
        if not any(a.name == "device" for a in func._schema.arguments):
            return None
        kwargs["device"] = torch.device("meta")
    try:
        metas = func(*tree_map(meta, tuple(args)), **kwargs)
    except Exception:  # no meta kernel, or results whose size depends on the data
        return None
    leaves = [value for _, value in result_leaves(fresh_returns, metas)]
    sized = all(m is None or isinstance(m, torch.Tensor) and m.is_meta for m in leaves)
    return leaves if sized and any(m is not None for m in leaves) else None


def meta(x: Any) -> Any:
    """``x`` as a meta tensor of the same geometry; a generator as a new one (a meta kernel may
    still draw from it); anything else as it is."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.Generator):
        return torch.Generator(device=x.device)
    return x
