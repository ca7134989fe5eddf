"""A region whose op writes in place a tensor made before it (NOTE [written from outside] in
``remat.planner.region_model``): an in-place ReLU opening a block over the previous block's
output. The tape snapshots the old value and hands autograd a handle for what it saves after the
write; the prediction counts the snapshot to the replay and the written tensor as a target, as the
allocator measures."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from models import assert_same, train, twin
from plans import fixed_costs
from torch import nn

import remat
from remat.planner import plan_trace, trace_step
from remat.planner.api import block_key, plan_at
from remat.planner.frontier import frontier
from remat.planner.search import Step, predicted


class _Net(nn.Module):
    """Blocks of (Linear, in-place ReLU): each ReLU writes the output of the Linear before it."""

    def __init__(self, w: int = 32, depth: int = 6) -> None:
        super().__init__()
        blocks = (nn.Sequential(nn.Linear(w, w), nn.ReLU(inplace=True)) for _ in range(depth))
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(w, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


@pytest.fixture(scope="module")
def traced() -> tuple[_Net, torch.Tensor, remat.trace.Trace]:
    torch.manual_seed(0)
    model, x = _Net().train(), torch.randn(256, 32)
    return model, x, fixed_costs(trace_step(model, (x,), repeats=1))


def _measured(model: nn.Module, x: torch.Tensor, plan: remat.Plan) -> int:
    model.zero_grad(set_to_none=True)
    with remat.memory.track(timeline=False, allocator=True) as tracked, plan.apply(model):
        model(x).backward()
    return tracked.peak_bytes


# forward positions: 3k is layer k's ``t``, 3k + 1 its ``addmm``, 3k + 2 its ReLU
SPANS = [
    [(2, 3)],  # a ReLU writing what was made before the region, and no other target
    [(8, 13)],  # a region opening with the ReLU: what its addmm saves is the ReLU's result
    [(0, 7), (8, 13)],  # the floor's plan: the previous region made what the next one writes
    [(2, 4), (5, 10)],
]


@pytest.mark.parametrize("spans", SPANS, ids=str)
def test_regions_writing_what_came_before_them_measure_as_predicted(
    traced: tuple[_Net, torch.Tensor, remat.trace.Trace], spans: list[tuple[int, int]]
) -> None:
    """Each plan measures its prediction, and trains as the plain model does. Before, a region
    opening with the ReLU was predicted to let its snapshot go at its end, while the tape holds it
    until the replay (one whole activation, 32 KiB, over for ``[(2, 3)]``)."""
    model, x, trace = traced
    key = block_key(model)
    step = Step(trace, key)
    made = [step.region(f"r{a}", [step.forward[p].index for p in range(a, b + 1)]) for a, b in spans]
    assert all(r is not None for r in made)
    regions = [r for r in made if r is not None]
    prediction = predicted(step, regions)
    plan = dataclasses.replace(plan_trace(trace, 1.0, block_key=key), regions=tuple(r for r, _ in regions))
    assert _measured(model, x, plan) == prediction.peak_bytes

    planned = twin(model)
    expected = train(twin(model), lambda _: {"x": x})
    assert_same(expected, train(planned, lambda _: {"x": x}, region=lambda: plan.apply(planned)))


@pytest.mark.parametrize("solver", ["auto", "chain", "sqrt"])
def test_each_solvers_smallest_plan_holds_its_budget(
    traced: tuple[_Net, torch.Tensor, remat.trace.Trace], solver: str
) -> None:
    """At the smallest budget a solver reaches, its plan measures within it (chain's and sqrt's
    measured 8,448 bytes, 5%, over: their regions open with a ReLU)."""
    model, x, trace = traced
    found = frontier(trace, solver, block_key(model))
    floor = min(c.pred.peak_bytes for c in found.candidates)
    plan = plan_at(found, floor)
    assert plan.regions  # it recomputes something
    assert _measured(copy.deepcopy(model), x, plan) <= floor
