"""Samples of a tensor's values: a recomputed tensor checked against the one a call saved (NOTE [a
template's replay checked])."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["same", "sample"]

# NOTE [a template's replay checked] A call run from its template cannot see an op that changed
# with Python state its setting does not reach while every saved tensor kept its shape, dtype and
# autograd node (NOTE [taped call run bare]): the replay would recompute with the recorded ops. So
# each tensor the call hands the replay to recompute leaves a sample of its values (a grid of about
# 64 elements spread over every dimension: a few microseconds, no memory the allocator counts), and
# the recomputed tensor must match it bit for bit, as a replay of the same ops does. A change that
# touches none of the sampled elements still passes; ``check="every"`` records every call. Only
# tensors in host memory are sampled: elsewhere reading one back would wait for the device, so on an
# accelerator nothing is checked. Nor is a tensor an op writes after autograd saved it (RReLU's
# noise, statistics batch norm updates: ``TapedRegion.rewritten``), which the replay gives back as
# the write left it; nor are
# byte buffers (uint8: a kernel's workspace, such as the reserve an LSTM saves, whose bytes the
# kernel never writes hold whatever the memory held). A replay through compiled graphs
# (``replay="compiled"``) is equal up to rounding, and so is the check (``rounded``).
_SAMPLED = 64


def sample(t: torch.Tensor) -> list[Any] | None:
    """About ``_SAMPLED`` elements of ``t`` on a grid over its dimensions, as Python values; None
    for a tensor not sampled (not in host memory, not plain, empty)."""
    if t.device.type != "cpu" or t.layout != torch.strided or type(t) not in _PLAIN_TENSORS or not t.numel():
        return None
    if t.dtype == torch.uint8 or t.is_quantized or t.is_complex() or t.is_conj() or t.is_neg():
        return None
    per = max(2, round(_SAMPLED ** (1 / t.dim()))) if t.dim() else 1
    jumps = [-(-size // per) for size in t.shape]
    grid = [-(-size // jump) for size, jump in zip(t.shape, jumps, strict=True)]
    strides = [stride * jump for stride, jump in zip(t.stride(), jumps, strict=True)]
    with torch.no_grad():
        return [torch.as_strided(t, grid, strides, t.storage_offset()).tolist()]


_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def same(a: list[Any] | None, b: list[Any], rounded: bool = False) -> bool:
    """Whether two samples hold the same values, not-a-number equal to itself; ``rounded``: up to
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
