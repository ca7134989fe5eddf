"""Tensors from before a region that are not in ``keep`` and that an op first reads mid-step: a
second input batch, and the gradients ``zero_grad(set_to_none=False)`` leaves for the backward to
accumulate into. The budget holds in the allocator's count on both backends (NOTE [arriving
constants] in ``remat.dynamic.keep``): for the gradients from the first step, for a second batch
from the step after the first that saw it (in the arena from the first, NOTE [beside the arena] in
``remat.dynamic.arena``), the gradients are those of a plain step, and the simulator,
registering each constant where the region first saw it (NOTE [first sight] in
``remat.sim.backend``), takes the region's decisions."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from models import ResidualMLP
from torch import nn

import remat
from remat.dynamic import DynamicStats

WIDTH, BATCH, SLICE = 64, 128, 8
RESERVE = {"accounting": 0.1, "arena": 0.25}  # the arena copies what the program keeps out beside it


def _model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Four residual blocks; a batch, and a second one that is a slice of a larger tensor (its
    whole storage arrives when an op first reads it)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[ResidualMLP(WIDTH) for _ in range(4)], nn.Linear(WIDTH, 1))
    return model, torch.randn(BATCH, WIDTH), torch.randn(SLICE * BATCH, WIDTH)[:BATCH]


def _steps(
    kind: str, backend: str, policy: str, ratio: float
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[int, DynamicStats]], int]:
    """Two plain steps and two budgeted ones (the first learns what arrives): the gradients of
    each, and the allocator's figure and the stats of each budgeted step."""
    model, x, second = _model()

    def step() -> None:  # with a second batch, its gradients are accumulated after the first's
        model(x).square().mean().backward()
        if kind == "batch":
            model(second).square().mean().backward()

    between: Callable[[], None] = lambda: model.zero_grad(set_to_none=kind == "batch")  # noqa: E731
    step()
    between()
    step()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    free = remat.dynamic(None, policy, keep=model, cost="model")
    for _ in range(2):  # the second one's peak counts the kernels' scratch the first learned
        with free:
            step()
        model.zero_grad(set_to_none=True)
    budget = int(ratio * free.stats.peak_bytes)
    region = remat.dynamic(
        budget, policy, backend=backend, keep=model, cost="model", reserve=RESERVE[backend], thrash_limit=50.0
    )
    measured = []
    for i in range(2):
        if i:
            between()
        with remat.memory.track(allocator=True) as track, region:
            step()
        measured.append((track.peak_bytes + region.stats.outside_bytes, region.stats))
    return plain, [p.grad for p in model.parameters()], measured, budget


# Of the pool's peak in an unbudgeted step that starts with no gradients: the gradients left at the
# entry, and each version the backward accumulates into them, count on top (NOTE [constants stay]).
# DTR on the addresses of the accounting backend, Coop in the arena (layout is real there).
SETUPS = {
    ("batch", "accounting"): ("dtr", 1.0),
    ("grads", "accounting"): ("dtr", 1.1),
    ("batch", "arena"): ("coop", 1.5),
    ("grads", "arena"): ("coop", 1.4),
}


@pytest.mark.parametrize("backend", ["accounting", "arena"])
@pytest.mark.parametrize("kind", ["batch", "grads"])
def test_what_arrives_mid_step_stays_within_the_budget(kind: str, backend: str) -> None:
    policy, ratio = SETUPS[kind, backend]
    plain, grads, measured, budget = _steps(kind, backend, policy, ratio)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain, strict=True))
    (first, entered), (allocated, stats) = measured
    assert allocated <= budget, (allocated, budget)
    if kind == "grads" or backend == "arena":  # held from the first step (or an error, in the arena)
        assert first <= budget, (first, budget)
    assert stats.evictions > 0
    # The second batch arrives (the next block sets its room aside), and in the arena the first one
    # too (its hole); the gradients at the entry are the kept parameters', registered with them.
    arrived = (SLICE * BATCH * WIDTH * 4 if kind == "batch" else 0) + (
        BATCH * WIDTH * 4 if backend == "arena" else 0
    )
    assert entered.arrived_bytes == stats.arrived_bytes == stats.arriving == arrived
    comparison = stats.compare()
    assert comparison.same_evictions
    assert comparison.simulated_recomputations == stats.recomputations
    assert comparison.simulated_peak == stats.peak_bytes
