"""Batch norm's running statistics in a recomputed region (NOTE [blank writes] in
``remat.manual.blank``): the region keeps no copy of them from its forward to its replay where
nothing else in it reads them, the replay leaves the real ones as the forward left them, and a
plan's prediction counts the same bytes the allocator does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from plans import fixed_costs
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat
from remat.planner import BudgetTooSmall, plan_trace, trace_step
from remat.planner.api import block_key

C = 4096


def block() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, C), nn.BatchNorm1d(C), nn.ReLU(), nn.Linear(C, 1))


def test_a_batch_norm_in_a_scope_trains_like_plain_bit_for_bit() -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    plain, recomputed = block(), block()
    for _ in range(2):
        for model in (plain, recomputed):
            model.zero_grad(set_to_none=True)
        plain(x).square().mean().backward()
        with remat.scope():
            y = recomputed[2](recomputed[1](recomputed[0](x)))
        recomputed[3](y).square().mean().backward()
        for a, b in zip(plain.parameters(), recomputed.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
        for a, b in zip(plain.buffers(), recomputed.buffers(), strict=True):
            assert torch.equal(a, b)


def _held_after_forward(read_statistics: bool) -> int:
    """Bytes the allocator holds after a region over linear, batch norm and ReLU has run forward
    (its output and what its tape keeps for the replay)."""
    model = block()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    with remat.memory.track(allocator=True, timeline=False) as tracked:
        with remat.scope():
            h = model[1](model[0](x))
            if read_statistics:  # other ops of the region read the statistics: the copies stay
                h = h + model[1].running_mean.sum() + model[1].running_var.sum()
            y = model[2](h)
        loss = model[3](y).sum()
    held = tracked.current_bytes
    loss.backward()
    return held


def test_the_region_keeps_no_copy_of_statistics_nothing_else_reads() -> None:
    statistics = 2 * C * 4  # running mean and variance, fp32
    assert (
        _held_after_forward(read_statistics=True) - _held_after_forward(read_statistics=False) >= statistics
    )


class _SaveStatistics(torch.autograd.Function):
    """Saves the running mean for backward with no ATen op reading it."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mean)
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Block(nn.Module):
    def __init__(self, c: int, kind: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.kind = kind
        assert self.bn.running_mean is not None
        self.view = self.bn.running_mean.view(1, c, 1, 1)  # a view taken before any region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x))
        if self.kind == "saved after the write":
            h = _SaveStatistics.apply(h, self.bn.running_mean)
        elif self.kind == "read through an outside view":
            h = h + self.view * 0
        return torch.relu(h) + x


class _Net(nn.Module):
    def __init__(self, kind: str = "plain") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(32, kind) for _ in range(4))
        self.checkpointed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x)
        return x.square().mean()


def _peak(net: _Net, x: torch.Tensor, plan: remat.Plan | None = None) -> int:
    net.zero_grad(set_to_none=True)
    with remat.memory.track(allocator=True, timeline=False) as tracked:
        if plan is None:
            net(x).backward()
        else:
            with plan.apply(net):
                net(x).backward()
    return tracked.peak_bytes


def test_a_batch_norm_plan_at_its_floor_measures_its_prediction_and_reaches_checkpointing() -> None:
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(4, 32, 16, 16)
    net.checkpointed = True
    checkpointed = _peak(net, x)
    net.checkpointed = False
    trace = fixed_costs(trace_step(net, (x,), lambda m, v: m(v), repeats=1))
    with pytest.raises(BudgetTooSmall) as info:
        plan_trace(trace, 1, block_key=block_key(net))
    floor = info.value.minimum_bytes
    plan = plan_trace(trace, floor, block_key=block_key(net))
    assert plan.regions  # the floor recomputes
    assert floor <= checkpointed
    assert _peak(net, x, plan) == plan.predicted_peak_bytes


@pytest.mark.parametrize("kind", ["saved after the write", "read through an outside view"])
def test_statistics_the_region_still_needs_keep_their_copy_in_the_prediction_too(kind: str) -> None:
    torch.manual_seed(0)
    net, x = _Net(kind), torch.randn(4, 32, 16, 16)
    trace = fixed_costs(trace_step(net, (x,), lambda m, v: m(v), repeats=1))  # the same plans every run
    with pytest.raises(BudgetTooSmall) as info:
        plan_trace(trace, 1, block_key=block_key(net))
    for budget in (info.value.minimum_bytes, int(info.value.minimum_bytes * 1.3)):
        plan = plan_trace(trace, budget, block_key=block_key(net))
        assert plan.regions
        assert _peak(net, x, plan) == plan.predicted_peak_bytes


class _Raises(nn.Module):
    """Raises in forward once ``armed``: the plan's region is still open then."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise ValueError("the model's own error")
        return x.relu()


def test_a_forward_that_raises_inside_a_batch_norm_region_raises_its_own_error() -> None:
    """The region is closed while the plan's dispatch mode is still pushed: closing it must run no
    op there (it would be taken for an op of the forward)."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 256), nn.BatchNorm1d(256), _Raises()]
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.BatchNorm1d(256), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(256, 1))
    x = torch.randn(512, 8)
    trace = trace_step(model, (x,), lambda m, v: m(v).sum(), repeats=1)
    with pytest.raises(BudgetTooSmall) as info:
        plan_trace(trace, 1)
    plan = plan_trace(trace, info.value.minimum_bytes)
    assert plan.regions
    model[2].armed = True
    with pytest.raises(ValueError, match="the model's own error"), plan.apply(model):
        model(x).sum().backward()
