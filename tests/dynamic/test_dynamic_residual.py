"""A residual network at half its peak: a pool whose addresses are a model is packed before the
locks of the ops waiting on a restore are dropped (NOTE [relaxed locks] in ``remat.core.runtime``),
and the step finishes exactly, where giving up those locks first made it thrash."""

from __future__ import annotations

import pytest
import torch
from budgeted import budgeted_step
from models import ResidualMLP
from torch import nn

RATIO = 0.5


def _residual() -> tuple[nn.Module, torch.Tensor]:
    """Six residual blocks of width 32 on a batch of 256."""
    torch.manual_seed(0)
    return nn.Sequential(*[ResidualMLP(32) for _ in range(6)], nn.Linear(32, 1)), torch.randn(256, 32)


@pytest.mark.parametrize("policy", ["dtr", "coop"])
def test_a_residual_step_at_half_its_peak_is_exact(policy: str) -> None:
    model, x = _residual()
    run = budgeted_step(model, x, policy, RATIO, free_cost="model")
    stats = run.stats
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), run.plain, strict=True))
    assert run.allocator_peak + stats.outside_bytes <= run.budget
    assert stats.recomputations > 0
    comparison = stats.compare()
    assert comparison.same_evictions
    assert comparison.simulated_recomputations == stats.recomputations
