"""Plans over code whose autograd graph lets go of what it saved, or writes it unseen: a gate cut
from the graph in place frees its sigmoid's node and the output that node saved (NOTE [dead
handles] in ``remat.manual.handles``), and an RReLU fills the noise it saved after the save (NOTE
[early stop] in ``remat.manual.early_stop``), in a module run again."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from plans import fixed_costs
from torch import nn

import remat
from remat import RecomputationError
from remat.planner import plan_trace, trace_step
from remat.planner.api import block_key, plan_at
from remat.planner.cost_model import ExecutorCost
from remat.planner.frontier import frontier
from remat.planner.lowering import chain_from_trace
from remat.planner.search import Step, simple

H = 32
TAPES_COST = ExecutorCost(record=1e-3, replay=1e-3)  # a tape costs: where it may, a module runs again


class _Gated(nn.Module):
    def __init__(self, cut: str) -> None:
        super().__init__()
        self.a, self.b, self.g, self.cut = nn.Linear(H, 2 * H), nn.Linear(2 * H, H), nn.Linear(H, H), cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.g(x))
        if self.cut == "detach_":
            gate.detach_()  # the sigmoid's node dies here, and the handle of the output it saved
        else:
            gate = gate.detach()
        h = self.a(x)
        h = torch.tanh(h) * torch.sigmoid(h)
        return x + self.b(torch.nn.functional.gelu(torch.sin(h) + h) * h) * gate


class _Net(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("cut", ["detach_", "detach"])
def test_every_plan_over_a_gate_cut_from_the_graph_measures_within_its_prediction(cut: str) -> None:
    """The region counted the sigmoid's handle when autograd packed it; its replay recomputed the
    value for an unpack that never came and held it to the end of the backward: 3.7 KB above the
    prediction and the budget at one plan of the search."""
    torch.manual_seed(0)
    model, x = _Net([_Gated(cut) for _ in range(3)]), torch.randn(2, 16, H)
    trace = fixed_costs(trace_step(model, (x,), repeats=1))
    found = frontier(trace, "auto", block_key(model), executor_cost=ExecutorCost())
    recomputing = 0
    for peak in sorted({c.pred.peak_bytes for c in found.candidates}):
        plan = plan_at(found, peak)
        recomputing += bool(plan.regions)
        model.zero_grad(set_to_none=True)
        with remat.memory.track(timeline=False, allocator=True) as tracked:
            with plan.apply(model):
                loss = model(x)
            loss.backward()
        assert tracked.peak_bytes <= plan.predicted_peak_bytes <= peak
    assert recomputing >= 2


@pytest.mark.parametrize("cut", ["detach_", "detach"])
def test_layers_run_again_over_a_gate_cut_from_the_graph_hold_what_torch_checkpoint_holds(cut: str) -> None:
    """A module run again kept the sigmoid's output for a handle whose node had died, to the end
    of the backward: 4 KB above ``torch.utils.checkpoint`` around each layer (NOTE [dead handles]
    in ``remat.manual.handles``)."""
    torch.manual_seed(0)
    model, x = _Net([_Gated(cut) for _ in range(3)]), torch.randn(2, 16, H)
    trace = fixed_costs(trace_step(model, (x,), repeats=1))
    key = block_key(model)
    candidates = simple(Step(trace, key, rerun_modules=True), chain_from_trace(trace, key=key))
    every = next(c for c in candidates if c.notes == "every layer checkpointed")
    assert all(region.rerun for region, _ in every.regions)
    plan = dataclasses.replace(plan_trace(trace, 1.0), regions=tuple(r for r, _ in every.regions))
    twin = copy.deepcopy(model)
    for layer in twin.layers:
        layer.forward = functools.partial(torch_checkpoint.checkpoint, layer.forward, use_reentrant=False)
    peaks = []
    for ran, context in ((model, lambda: plan.apply(model)), (twin, contextlib.nullcontext)):
        for _ in range(2):  # the second step: the allocator's scratch learned
            ran.zero_grad(set_to_none=True)
            with remat.memory.track(timeline=False, allocator=True) as tracked:
                with context():
                    loss = ran(x)
                loss.backward()
        peaks.append(tracked.peak_bytes)
    assert peaks[0] <= peaks[1]


class _Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.noise = nn.Linear(16, 16), nn.RReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.noise(self.linear(x))


def test_a_module_whose_last_kernel_fills_what_it_saved_is_not_run_again() -> None:
    """RReLU saves the noise made for it, then its input, and only then fills the noise: a module
    run again stopped at its last save (as ``torch.utils.checkpoint`` does) and handed backward
    unwritten memory, and every gradient differed from the plain model's. Such a region stays on
    its tape (NOTE [module re-run] in ``remat.planner.rerun_regions``)."""
    torch.manual_seed(0)
    model, x = _Net([_Noisy() for _ in range(4)]), torch.randn(64, 16)
    trace = fixed_costs(trace_step(model, (x,), repeats=1))
    plan = plan_trace(trace, "min", block_key=block_key(model), rerun_modules=True, executor_cost=TAPES_COST)
    assert plan.regions and not any(region.rerun for region in plan.regions)
    _trains_as_plain(model, x, plan)


class _Dropped(nn.Module):
    """A block ending in dropout: on CPU ``x * mask``, whose mask is outside the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.drop = nn.Linear(H, 16), nn.Linear(16, H), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.l2(torch.relu(self.l1(x))))


def test_a_module_ending_in_dropout_runs_again_to_its_last_save_as_predicted() -> None:
    """Its last save is the mask, an argument of the product outside the graph: a first rule ran
    the module on to its end (the product and the residual sum), 13,312 bytes over the
    prediction, where the product writes nothing it saved and the re-run may stop before it."""
    torch.manual_seed(0)
    model, x = _Net([_Dropped() for _ in range(3)]), torch.randn(64, H)
    trace = fixed_costs(trace_step(model, (x,), repeats=1))
    plan = plan_trace(trace, "min", block_key=block_key(model), rerun_modules=True, executor_cost=TAPES_COST)
    assert any(region.rerun for region in plan.regions)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with remat.memory.track(timeline=False, allocator=True) as tracked:
            with plan.apply(model):
                loss = model(x)
            loss.backward()
        assert tracked.peak_bytes <= plan.predicted_peak_bytes
    _trains_as_plain(model, x, plan)


def _trains_as_plain(model: nn.Module, x: torch.Tensor, plan: remat.Plan) -> None:
    """Two steps with dropout's draws: every gradient equal to the plain model's, bit for bit."""
    for step in range(2):
        torch.manual_seed(5 + step)
        model.zero_grad(set_to_none=True)
        model(x).backward()
        expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        torch.manual_seed(5 + step)
        model.zero_grad(set_to_none=True)
        with plan.apply(model):
            loss = model(x)
        loss.backward()
        assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True))  # type: ignore[arg-type]


class _Exposed(nn.Module):
    """A block that also returns a view of a tensor autograd saved (``tanh``'s result)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.a(x).tanh()
        return x + self.b(t), t[:, :H]


class _ExposedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Exposed() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        views = []
        for layer in self.layers:
            x, view = layer(x)
            views.append(view)
        return x.pow(2).mean(), views


def test_a_saved_tensor_the_program_writes_after_its_region_is_refused_in_every_forward() -> None:
    """Plain autograd refuses the backward; the plan's taped regions replayed the forward's value
    and went on, in the recorded forward and in those run from its template (NOTE [written after
    the region] in ``remat.manual.handles``)."""
    torch.manual_seed(0)
    model, x = _ExposedNet(), torch.randn(64, H)
    trace = fixed_costs(trace_step(model, (x,), lambda m, x: m(x)[0], repeats=1))
    plan = plan_trace(trace, "min", block_key=block_key(model), executor_cost=ExecutorCost())
    assert [r.anchor for r in plan.regions if not r.rerun] == ["layers.0"]  # a taped call, templated
    for write in (True, True, True, False):  # recorded, then run from its template
        with plan.apply(model):
            loss, views = model(x)
        if not write:
            loss.backward()
            break
        views[0].mul_(2)
        with pytest.raises(
            RecomputationError, match=r"remat\.plan: a tensor saved for backward was modified in place"
        ):
            loss.backward()
