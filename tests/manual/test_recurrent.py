"""Recurrent layers in every form that records or moves what the forward saved.

- ``unsafe_chunk`` and ``unsafe_split`` (a GRU cell: ``gates = x @ w; a, b = gates.unsafe_chunk(2, 1)``
  then ``a.sigmoid_()``, ``b.tanh_()``) return tensors on one storage, each with a version counter
  of its own. A region that kept ``gates`` saw neither write and replayed them onto the already
  written tensor; the offloader took ``b`` for ``a``'s copy, taken before ``b`` was written.
- ``nn.LSTM``'s CPU kernel (``mkldnn_rnn_layer``) returns the workspace its backward reads only
  with grad mode on, and a replay runs without it (``remat.aten.GRAD_MODE_PACKETS``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from plans import fixed_costs
from torch import nn

import remat
from remat.aten import geometry, overlaps
from remat.planner import BudgetTooSmall, plan_trace, trace_step

Fn = Callable[[torch.Tensor], torch.Tensor]


def _gru_cell(w: torch.Tensor) -> Fn:
    def cell(x: torch.Tensor) -> torch.Tensor:
        a, b = (x @ w).unsafe_chunk(2, 1)
        a = a.sigmoid_()
        b = b.tanh_()
        return (a * b).sum() + a.pow(2).sum()

    return cell


def _scope(**options: object) -> Callable[[Fn, torch.Tensor], torch.Tensor]:
    def run(f: Fn, x: torch.Tensor) -> torch.Tensor:
        with remat.scope(**options):  # type: ignore[arg-type]
            return f(x)

    return run


def _offload(f: Fn, x: torch.Tensor) -> torch.Tensor:
    with remat.offload(min_bytes="1B"):
        return f(x)


FORMS = {
    "scope": _scope(),
    "scope-save-mm": _scope(policy=remat.SaveOps(frozenset({"aten.mm"}))),
    "scope-offload": _scope(policy=remat.OffloadLarger("1B")),
    "offload": _offload,
    "checkpoint-save-mm": lambda f, x: remat.checkpoint(f, x, policy=remat.SaveOps(frozenset({"aten.mm"}))),
    "checkpoint-values": lambda f, x: remat.checkpoint(f, x, check="values"),  # LSTM's workspace varies
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_writes_through_unsafe_chunks_replay_as_the_forward_ran_them(form: str) -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    cell = _gru_cell(w)
    cell(x).backward()
    expected = (x.grad.clone(), w.grad.clone())  # type: ignore[union-attr]
    x.grad = w.grad = None
    FORMS[form](cell, x).backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["gru", "lstm"])
@pytest.mark.parametrize("form", ["scope", "scope-save-mm", "offload", "checkpoint-values"])
def test_recurrent_modules_match_the_plain_step(kind: str, form: str) -> None:
    torch.manual_seed(0)
    rnn = (nn.GRU if kind == "gru" else nn.LSTM)(8, 8, num_layers=2, batch_first=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    rnn(x)[0].pow(2).sum().backward()
    expected = [p.grad.clone() for p in (x, *rnn.parameters())]  # type: ignore[union-attr]
    rnn.zero_grad(set_to_none=True)
    x.grad = None
    FORMS[form](lambda h: rnn(h)[0].pow(2).sum(), x).backward()
    for got, want in zip((x, *rnn.parameters()), expected, strict=True):
        assert torch.equal(got.grad, want)  # type: ignore[arg-type]


class _Stacked(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        cls = nn.GRU if kind == "gru" else nn.LSTM
        self.rnns = nn.ModuleList([cls(16, 16, batch_first=True) for _ in range(3)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for rnn in self.rnns:
            h = h + rnn(h)[0]
        return self.head(h).pow(2).mean()


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_a_plan_over_recurrent_layers_holds_its_budget_with_exact_gradients(kind: str) -> None:
    torch.manual_seed(0)
    model = _Stacked(kind).train()
    batches = [torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    trace = fixed_costs(trace_step(model, (batches[0],), repeats=1))
    with pytest.raises(BudgetTooSmall) as info:
        plan_trace(trace, 1)
    for budget in (info.value.minimum_bytes, int(1.2 * info.value.minimum_bytes)):
        plan = plan_trace(trace, budget)
        assert any(region.save for region in plan.regions), "a plan that keeps nothing would prove nothing"
        plain = copy.deepcopy(model)
        plain(batches[1]).backward()
        model.zero_grad(set_to_none=True)
        with remat.memory.track(timeline=False, allocator=True) as tracked, plan.apply(model):
            model(batches[1]).backward()
        assert tracked.peak_bytes <= budget
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]


def test_overlap_of_interleaved_rows_is_told_exactly() -> None:
    gates = torch.zeros(4, 16)
    a, b = gates.unsafe_chunk(2, 1)
    assert not overlaps(geometry(a), geometry(b))
    assert overlaps(geometry(a), geometry(gates[:, 7:9]))
    assert not overlaps(geometry(a), geometry(gates[:, 8:0]))  # empty
    wide = torch.zeros(1 << 9, 1 << 9)
    left, right = wide.unsafe_chunk(2, 1)
    assert not overlaps(geometry(left), geometry(right))
    assert overlaps(geometry(left), geometry(right), limit=16)  # too many runs: their extents meet
