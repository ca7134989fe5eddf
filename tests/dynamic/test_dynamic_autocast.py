"""A step under autocast inside ``remat.dynamic``: an op the program ran with autocast off inside
autocast (as rotary embeddings compute their angles in float32) is run again as it first ran, not
cast once more by the autocast of the op that needed it (NOTE [ops as they ran] in
``remat.dynamic.recipe``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import remat


class _Mixed(nn.Module):
    """Blocks that each compute a float32 part with autocast off and a bfloat16 part under it."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.exact = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.cast = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        every: list[torch.Tensor] = []
        for exact, cast in zip(self.exact, self.cast, strict=True):
            with torch.autocast("cpu", enabled=False):
                angles = torch.tanh(exact(h.float()))
            every.append(angles)
            h = h + cast(angles).relu()
        # read again at the end, by ops autocast passes through: evicted by then, remade there
        return h.float().square().mean() + torch.stack([a.cos().mean() for a in every]).sum()


def _step(
    model: nn.Module, x: torch.Tensor, region: contextlib.AbstractContextManager[object]
) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), region:
        loss = model(x)
        loss.backward()
    return loss.detach()


@pytest.mark.parametrize("policy", ["dtr", "coop"])
def test_a_step_under_autocast_recomputes_ops_as_they_ran(policy: str) -> None:
    torch.manual_seed(0)
    model, x = _Mixed(32, 6), torch.randn(256, 32)
    loss = _step(model, x, contextlib.nullcontext())
    plain = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    free = remat.dynamic(None, policy, keep=model, cost="model")
    for _ in range(2):
        _step(model, x, free)
    # tight (recomputation a hundred times the first runs is let pass): ops are remade in forward,
    # where the program's autocast is on
    budget = int(0.45 * free.stats.peak_bytes)
    region = remat.dynamic(budget, policy, keep=model, cost="model", reserve=0.1, thrash_limit=100.0)
    with remat.memory.track(allocator=True) as measured:
        again = _step(model, x, region)
    assert region.stats.recomputations > 0
    assert torch.equal(again, loss)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain, strict=True))
    assert measured.peak_bytes + region.stats.outside_bytes <= budget
