"""What the program holds after autograd saved it (NOTE [let go] in ``remat.trace.let_go``): a plan
that recomputes a tensor the program still holds (a local after its last reader, a value a block
returns) is predicted as the allocator measures it, and holds its budget."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from plans import fixed_costs
from torch import nn

import remat
from remat.planner.api import plan_trace, trace_step
from remat.trace import load, save


class _Attention(nn.Module):
    """Bloom's attention in short: ``q`` and ``k`` stay locals after the matmul that saves them, and
    the dropped-out probabilities go back to the caller, which keeps them."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = (t.contiguous() for t in self.qkv(x).chunk(3, -1))
        scores = torch.bmm(q, k.transpose(1, 2))  # the last reader of q and k, which save them
        probs = self.drop(torch.softmax(scores, -1))
        return x + self.out(torch.bmm(probs, v)), probs


class _Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Attention(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = []
        for layer in self.layers:
            x, probs = layer(x)
            kept.append(probs)  # held until the model returns
        return x.square().mean()


Traced = tuple["_Net", torch.Tensor, remat.trace.Trace]


def _peak(model: nn.Module, x: torch.Tensor, plan: remat.Plan) -> int:
    model.zero_grad(set_to_none=True)
    with remat.memory.track(timeline=False, allocator=True) as tracked, plan.apply(model):
        model(x).backward()
    return tracked.peak_bytes


@pytest.fixture(scope="module")
def traced() -> Traced:
    torch.manual_seed(0)
    model, x = _Net().train(), torch.randn(4, 64, 16)
    return model, x, fixed_costs(trace_step(model, (x,), repeats=1))


def test_the_trace_knows_when_the_program_let_go(
    traced: Traced,
) -> None:
    """``q`` and ``k`` go when their layer returns, the probabilities when the model does, although
    their last forward readers come earlier and autograd holds all of them until backward."""
    _, _, trace = traced
    let_go = dict(trace.let_go)
    assert set(let_go) <= trace.saved_roots
    spans = trace.module_spans
    model_end = max(op.index for op in trace.ops if op.module and op.phase.value == "forward")
    for i in range(2):
        layer = f"layers.{i}"
        bmm = [op for op in trace.ops if op.name == "aten.bmm.default" and op.module == layer]
        q, k = (trace.root(t) for t in bmm[0].inputs)
        probs = trace.root(bmm[1].inputs[0])
        assert let_go[q] == let_go[k] == spans[layer][1] > bmm[0].index
        assert let_go[probs] == model_end > bmm[1].index


def test_let_go_survives_a_file(tmp_path: Path, traced: Traced) -> None:
    _, _, trace = traced
    save(trace, tmp_path / "t.jsonl")
    assert load(tmp_path / "t.jsonl").let_go == trace.let_go


@pytest.mark.parametrize("fraction", [0.9, 0.8, 0.7])
def test_plans_hold_what_the_program_holds(traced: Traced, fraction: float) -> None:
    model, x, trace = traced
    plan = plan_trace(trace, fraction)
    assert plan.regions
    measured = _peak(copy.deepcopy(model), x, plan)
    assert measured <= plan.budget_bytes
    assert measured == plan.predicted_peak_bytes


class _Scaled(_Net):
    """A loss ending in a Python number (``loss / 4``, as in gradient accumulation): autograd saves
    the number's 0-dim tensor (NOTE [wrapped numbers] in ``remat.aten.schema``), which only the
    traced step, whose backward runs, sees."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / 4


def test_a_loss_divided_by_a_number_keeps_let_go() -> None:
    torch.manual_seed(0)
    model, x = _Scaled().train(), torch.randn(4, 64, 16)
    trace = fixed_costs(trace_step(model, (x,), repeats=1))
    assert trace.let_go  # a plan over 13% above its budget had lost them
    for fraction in (0.9, 0.7):
        plan = plan_trace(trace, fraction)
        assert _peak(copy.deepcopy(model), x, plan) == plan.predicted_peak_bytes <= plan.budget_bytes


class _Alternating(nn.Module):
    """Takes another path at every call: the forward run again is not the one traced."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.linear(x)
        return (h.tanh() if self.calls % 2 else h.sigmoid()).sum()


def test_a_forward_that_takes_another_path_gives_nothing() -> None:
    trace = trace_step(_Alternating(), (torch.randn(4, 8),), repeats=1)
    assert trace.saved_roots and trace.let_go == ()


def test_a_model_captured_with_its_optimizer_gets_it_too(traced: Traced) -> None:
    """``remat.trace.capture(model, ...)`` (``remat trace``) runs the forward once more as well,
    leaving the model and the generator as its one training step left them."""
    from remat.trace import capture

    model, x, trace = traced
    plain, captured_model = copy.deepcopy(model), copy.deepcopy(model)
    start = torch.get_rng_state()
    plain(x).backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    after = torch.get_rng_state()
    torch.set_rng_state(start)
    optimizer = torch.optim.SGD(captured_model.parameters(), lr=0.1)
    captured = capture(captured_model, (x,), lambda out: out, optimizer=optimizer)
    assert dict(captured.let_go) == dict(trace.let_go)
    assert torch.equal(torch.get_rng_state(), after)
    for a, b in zip(plain.parameters(), captured_model.parameters(), strict=True):
        assert torch.equal(a, b)
