"""A tensor's place in its storage, as the dispatch modes key and describe tensors."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

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


def version_witness(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares ``t``'s version counter and none of its memory: it tells whether ``t`` was
    written in place since, also once ``t`` is gone. Made outside any dispatch mode."""
    witness = t.detach()
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(witness):
        witness.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage())
    return witness


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
