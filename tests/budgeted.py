"""One training step of a model inside ``remat.dynamic`` at a fraction of its own unbudgeted peak,
measured by the allocator: the setup the dynamic runtime's end-to-end tests share."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

import remat
from remat.dynamic import DynamicStats


class Budgeted(NamedTuple):
    plain: list[torch.Tensor]  # the plain step's gradients
    budget: int
    allocator_peak: int  # remat.memory.track(allocator=True) over the budgeted step
    stats: DynamicStats


def budgeted_step(
    model: nn.Module, x: torch.Tensor, policy: str, ratio: float, free_cost: str | None = None, **options: Any
) -> Budgeted:
    """A plain step, two unbudgeted region steps (the second one's peak counts the scratch the
    first learned), then one step at ``ratio`` of that peak with ``options`` (``cost="model"``,
    ``reserve=0.1`` unless given; ``keep=model`` unless given). ``free_cost`` is the unbudgeted
    regions' ``cost``."""
    model(x).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    keep = options.pop("keep", model)
    free = remat.dynamic(None, policy, keep=keep, **({} if free_cost is None else {"cost": free_cost}))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with free:
            model(x).square().mean().backward()
    budget = int(ratio * free.stats.peak_bytes)
    region = remat.dynamic(budget, policy, keep=keep, **{"cost": "model", "reserve": 0.1, **options})
    model.zero_grad(set_to_none=True)
    with remat.memory.track(allocator=True) as measured, region:
        model(x).square().mean().backward()
    return Budgeted(plain, budget, measured.peak_bytes, region.stats)
