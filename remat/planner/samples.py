"""Samples of a tensor's values: a recomputed tensor checked against the one a call saved (NOTE [a
template's replay checked])."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Sample", "Waiting", "check", "sample", "same", "settle"]

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
# while its copy is queued, which no GPU run has measured yet) and compared when the backward pass
# ends (a callback of autograd's engine after the last node), after one wait for the device: the
# error then comes from ``backward`` before the optimizer can use the gradients, which autograd has
# already written (each backward settles its own checks; one that fails lets them go). A device
# without pinned memory (not CUDA) copies each sample when it is taken, waiting for the device.
# Not sampled: a tensor an op writes after autograd saved it (RReLU's noise, statistics batch norm
# updates: ``TapedRegion.rewritten``), which the replay gives back as the write left it; byte
# buffers (uint8: a kernel's workspace, such as the reserve an LSTM saves, whose bytes the kernel
# never writes hold whatever the memory held), and numbers Python cannot read back. A replay
# through compiled graphs (``replay="compiled"``) is equal up to rounding, and so is the check
# (``rounded``).
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


# numbers Python can read back (``tolist``) and flags; not bytes (uint8: a kernel's workspace),
# complex, quantized or packed numbers (float4, int4)
_SAMPLED_DTYPES = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.bool}
    | {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint64, torch.uint32, torch.uint16}
    | {
        getattr(torch, n)
        for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)
    }
)
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


class Waiting:
    """The checks of one backward pass waiting for their copies, settled by the callback it is
    queued as; autograd holds it only in that callback, so a backward that fails lets it go with
    them (no later backward settles another's checks)."""

    __slots__ = ("__weakref__", "checks")

    def __init__(self) -> None:
        self.checks: list[_Pending] = []

    def __call__(self) -> None:
        settle(self)


# per running backward pass (autograd's graph task), its checks; CUDA's backward runs on a thread
# per device, so appends are locked
_waiting: weakref.WeakValueDictionary[int, Waiting] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def check(saved: Sample, t: torch.Tensor, rounded: bool, refusal: Callable[[], Exception]) -> None:
    """Check the recomputed ``t`` against the sample the call left: at once where both are read,
    else when the backward pass ends (``settle``); ``refusal`` makes the error a difference raises
    (it holds no tensor: it may wait to the end of the backward)."""
    again = sample(t)
    if again is None:
        raise refusal()
    if saved.values is not None and again.values is not None:
        if not same(again.values, saved.values, rounded):
            raise refusal()
        return
    task = torch._C._current_graph_task_id()
    if task < 0:  # not in a backward pass (a saved tensor read by hand): settled at once
        alone = Waiting()
        alone.checks.append(_Pending(saved, again, rounded, refusal))
        settle(alone)
        return
    with _lock:
        waiting = _waiting.get(task)
        first = waiting is None
        if waiting is None:
            waiting = _waiting[task] = Waiting()
        waiting.checks.append(_Pending(saved, again, rounded, refusal))
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(waiting)


def settle(waiting: Waiting) -> None:
    """Compare the samples of ``waiting`` once their copies are done (one wait per device), and
    raise the first difference's error."""
    with _lock:
        checks, waiting.checks = waiting.checks, []
    devices = {s.device for p in checks for s in (p.saved, p.again) if s.device is not None}
    for device in devices:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
    for p in checks:
        if not same(_values(p.again), _values(p.saved) or [], p.rounded):
            raise p.refusal()


def _values(s: Sample) -> list[Any] | None:
    return s.values if s.values is not None else [s.host.tolist()] if s.host is not None else None
