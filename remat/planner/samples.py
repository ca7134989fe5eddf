"""Samples of a tensor's values: a recomputed tensor checked against the one a call saved (NOTE [a
template's replay checked])."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Sample", "check", "sample", "same", "settle"]

# NOTE [a template's replay checked] A call run from its template cannot see an op that changed
# with Python state its setting does not reach while every saved tensor kept its shape, dtype and
# autograd node (NOTE [taped call run bare]): the replay would recompute with the recorded ops. So
# each tensor the call hands the replay to recompute leaves a sample of its values (a grid of about
# 64 elements spread over every dimension), and the recomputed tensor must match it bit for bit, as
# a replay of the same ops does; a change that touches none of the sampled elements still passes,
# and ``check="every"`` records every call. In host memory the sample is read at once (a few
# microseconds, no memory the allocator counts) and the recomputed one when it is unpacked. On an
# accelerator reading values back waits for the device, so both grids are copied to host memory
# without waiting (pinned on CUDA: a grid of a few hundred bytes the device's allocator holds only
# while its copy is queued) and compared when the backward pass ends (a callback of autograd's
# engine after the last node), after one wait for the device: the error then comes from
# ``backward`` before the optimizer can use the gradients, which autograd has already written. Not
# sampled: a tensor an op writes after autograd saved it (RReLU's noise, statistics batch norm
# updates: ``TapedRegion.rewritten``), which the replay gives back as the write left it; byte
# buffers (uint8: a kernel's workspace, such as the reserve an LSTM saves, whose bytes the kernel
# never writes hold whatever the memory held). A replay through compiled graphs
# (``replay="compiled"``) is equal up to rounding, and so is the check (``rounded``).
_SAMPLED = 64
_DEFER_IN_HOST_MEMORY = False  # host tensors checked at the end of backward too, as on a device


class Sample(NamedTuple):
    """A tensor's grid of values: read (``values``), or being copied to ``host`` from ``device``."""

    values: list[Any] | None = None
    host: torch.Tensor | None = None
    device: torch.device | None = None


def sample(t: torch.Tensor) -> Sample | None:
    """About ``_SAMPLED`` elements of ``t`` on a grid over its dimensions; None for a tensor not
    sampled (not plain, empty, bytes, without values)."""
    if type(t) not in _PLAIN_TENSORS or t.dtype not in _SAMPLED_DTYPES or t.layout != torch.strided:
        return None
    if not t.numel() or t.is_meta or t.is_conj() or t.is_neg():
        return None
    grid, strides = _grid(t.shape, t.stride())
    with torch.no_grad():
        view = torch.as_strided(t, grid, strides, t.storage_offset())
        if t.device.type == "cpu" and not _DEFER_IN_HOST_MEMORY:
            return Sample(values=[view.tolist()])
        pinned = t.device.type == "cuda"
        host = torch.empty(grid, dtype=t.dtype, pin_memory=pinned)
        host.copy_(view, non_blocking=pinned)
    return Sample(host=host, device=t.device)


@functools.lru_cache(maxsize=4096)
def _grid(shape: torch.Size, stride: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """The sample's sizes and strides for a tensor of ``shape`` and ``stride``."""
    per = max(2, round(_SAMPLED ** (1 / len(shape)))) if shape else 1
    jumps = [-(-size // per) for size in shape]
    grid = [-(-size // jump) for size, jump in zip(shape, jumps, strict=True)]
    return grid, [s * jump for s, jump in zip(stride, jumps, strict=True)]


# floating and signed integer numbers and flags; not bytes (uint8: a kernel's workspace), complex or
# quantized numbers
_SAMPLED_DTYPES = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point
) | {
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.bool,
}
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def same(a: list[Any] | None, b: list[Any], rounded: bool = False) -> bool:
    """Whether two samples' values are the same, not-a-number equal to itself; ``rounded``: up to
    the rounding of kernels that sum in another order."""
    if a == b:
        return True
    if a is None:
        return False
    x, y = torch.tensor(a), torch.tensor(b)
    if not x.is_floating_point() or x.shape != y.shape:
        return False
    rtol = _ROUNDING if rounded else 0.0
    atol = rtol * float(y.abs().nan_to_num(0.0, 0.0, 0.0).max()) if y.numel() else 0.0
    return bool(torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True).all())


_ROUNDING = 1e-2  # relative, of the sample's largest magnitude: a kernel summing in another order


@dataclass(frozen=True)
class _Pending:
    saved: Sample
    again: Sample
    rounded: bool
    refusal: Callable[[], Exception]


_pending: list[_Pending] = []
_lock = threading.Lock()  # CUDA's backward runs on a thread per device


def check(saved: Sample, t: torch.Tensor, rounded: bool, refusal: Callable[[], Exception]) -> None:
    """Check the recomputed ``t`` against the sample the call left: at once where both are read,
    else when the backward pass ends (``settle``); ``refusal`` makes the error a difference raises."""
    again = sample(t)
    if again is None:
        raise refusal()
    if saved.values is not None and again.values is not None:
        if not same(again.values, saved.values, rounded):
            raise refusal()
        return
    with _lock:
        _pending.append(_Pending(saved, again, rounded, refusal))
    try:  # once per check: the first callback settles them all, the others find nothing
        torch.autograd.Variable._execution_engine.queue_callback(settle)
    except RuntimeError:  # not in a backward pass: a saved tensor read by hand
        settle()


def settle() -> None:
    """Compare the samples waiting for their copies: after one wait per device, raise the first
    difference's error."""
    with _lock:
        waiting = list(_pending)
        _pending.clear()
    devices = {s.device for p in waiting for s in (p.saved, p.again) if s.device is not None}
    for device in devices:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
    for p in waiting:
        if not same(_values(p.again), _values(p.saved) or [], p.rounded):
            raise p.refusal()


def _values(s: Sample) -> list[Any] | None:
    return s.values if s.values is not None else [s.host.tolist()] if s.host is not None else None
