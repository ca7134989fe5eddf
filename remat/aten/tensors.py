"""A tensor's place in its storage, as the dispatch modes key and describe tensors."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

Geometry = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]
"""(storage offset, shape, stride, dtype): what tells two tensors on one storage apart."""


def geometry(t: torch.Tensor) -> Geometry:
    return int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage, or None where it has no single one (sparse and nested tensors)."""
    if t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


_SEQUENCE = getattr(torch._C._autograd, "_get_sequence_nr", None)  # torch 2.x; None where absent


def next_node() -> int | None:
    """The number the next autograd node made on this thread gets; None where torch cannot tell."""
    return _SEQUENCE() if _SEQUENCE is not None else None


def made_last(t: torch.Tensor) -> bool:
    """Whether ``t`` is a result of the autograd node made last: saved by its op after the op ran.
    An input an op saves before it runs is saved once the op's own node exists, so it is not."""
    node = t.grad_fn
    return node is not None and _SEQUENCE is not None and node._sequence_nr() == _SEQUENCE() - 1


def version_witness(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares ``t``'s version counter and none of its memory: it tells whether ``t`` was
    written in place since, also once ``t`` is gone. Made below any dispatch mode, but called where
    autograd runs (a saved-tensor hook, not inside ``__torch_dispatch__``): there ``detach`` makes a
    version counter of its own, which never moves."""
    with torch._C._DisableTorchDispatch():
        witness = t.detach()
        # a lazy conjugate or negative view's ``set_`` resolves the bit into the old storage and
        # keeps it: clear the bits (the witness's values are never read)
        torch._C._set_conj(witness, False)
        torch._C._set_neg(witness, False)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(witness):
            witness.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage())
    return witness


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()``, sharing ``t``'s version counter also when called inside a dispatch mode's
    ``__torch_dispatch__``: autograd's keys are excluded there, and a plain ``detach`` is a bare alias
    with a version counter of its own (an in-place write to ``t`` would not show on it). They are let
    back in for this one call."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    keys = excluded.remove(torch._C.DispatchKey.AutogradFunctionality).remove(
        torch._C.DispatchKey.ADInplaceOrView
    )
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keys):
        return t.detach()


def same_counter(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share a version counter: views do, the results of ``unsafe_split`` and
    ``unsafe_chunk`` on one storage do not (each may be written unseen by the others). Told by
    moving ``a``'s counter and moving it back."""
    version = a._version
    if b._version != version:
        return False
    with torch.autograd._unsafe_preserve_version_counter(a):
        torch.autograd.graph.increment_version(a)
        return b._version == version + 1


def overlaps(a: Geometry, b: Geometry, limit: int = 1 << 16) -> bool:
    """Whether two tensors of one storage, given by their :func:`geometry`, may share a byte: the
    rows of ``unsafe_chunk``'s results interleave without touching. Exact where each has at most
    ``limit`` runs of contiguous elements, else True where their extents meet."""
    runs_a, runs_b = _runs(a, limit), _runs(b, limit)
    if runs_a is None or runs_b is None:
        (start_a, end_a), (start_b, end_b) = _extent(a), _extent(b)
        return start_a < end_b and start_b < end_a
    (starts_a, length_a), (starts_b, length_b) = runs_a, runs_b
    if starts_a.size == 0 or starts_b.size == 0:
        return False
    starts_a = np.sort(starts_a)
    ends_b = starts_b + length_b
    # the last run of ``a`` starting before each run of ``b`` ends: it meets it if it ends after
    # that run starts (``a``'s runs have one length: the last one starting before has the last end)
    last = np.searchsorted(starts_a, ends_b, side="left") - 1
    hit = last >= 0
    return bool(np.any(starts_a[last[hit]] + length_a > starts_b[hit]))


def _extent(g: Geometry) -> tuple[int, int]:
    offset, shape, stride, dtype = g
    if 0 in shape:
        return offset * dtype.itemsize, offset * dtype.itemsize
    last = sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    return offset * dtype.itemsize, (offset + last + 1) * dtype.itemsize


def _runs(g: Geometry, limit: int) -> tuple[np.ndarray, int] | None:
    """The byte offsets where ``g``'s runs of contiguous elements start, and their length in bytes;
    None where there are more than ``limit`` runs."""
    offset, shape, stride, dtype = g
    dims = [(n, s) for n, s in zip(shape, stride, strict=True) if n != 1]
    if any(n == 0 for n, _ in dims):
        return np.zeros(0, dtype=np.int64), 0
    inner = next((i for i, (_, s) in enumerate(dims) if s == 1), None)
    length = dims.pop(inner)[0] if inner is not None else 1
    if math.prod(n for n, _ in dims) > limit:
        return None
    starts = np.array([offset], dtype=np.int64)
    for n, s in dims:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
    return starts * dtype.itemsize, length * dtype.itemsize


def sharing(out: torch.Tensor, args: Sequence[Any]) -> int:
    """The position of the tensor in ``args`` whose storage ``out`` shares, or -1: a result a
    schema promises new may be a view all the same (``_unsafe_view``)."""
    storage = storage_of(out)
    if storage is None or storage.nbytes() == 0:
        return -1
    ptr = storage.data_ptr()
    for k, a in enumerate(args):
        if isinstance(a, torch.Tensor) and (s := storage_of(a)) is not None and s.data_ptr() == ptr:
            return k
    return -1


@functools.cache  # a dispatch mode names the dtype of every new tensor
def dtype_name(dtype: torch.dtype) -> str:
    """``float32``: how traces and errors name a dtype."""
    return str(dtype).removeprefix("torch.")


def describe(dtype: torch.dtype, shape: Sequence[int]) -> str:
    """``float32[4, 8]``: how errors name a tensor."""
    return f"{dtype_name(dtype)}{list(shape)}"
