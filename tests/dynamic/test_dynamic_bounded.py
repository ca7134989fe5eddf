"""Ops whose result's size depends on the data (``nonzero``, ``masked_select``, ``x[mask]``) are
placed at the most they can make before they run (NOTE [bounded ops] in
``remat.dynamic.sizing``): the budget holds in the allocator's count whatever the data, where they
ran first and passed it by what the reserve lacked (with a warning to raise it)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import remat
from remat.dynamic.accounting import AccountingBackend

RATIOS = [0.9, 0.75]


class _Selecting(nn.Module):
    """Each layer keeps what passes a test of its values: a third of a 256 x 128 activation."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.new_zeros(())
        for layer in self.layers:
            x = torch.tanh(layer(x))
            total = total + torch.masked_select(x, x > 0.3).sum()  # about a third of x
            total = total + x[x[:, 0] > 0].square().mean()  # rows
            total = total + (x > 0.9).nonzero().shape[0] * 1e-4  # where, as int64 pairs
        return x * total


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("policy", ["dtr", "coop"])
def test_data_dependent_sizes_hold_the_budget(
    policy: str, ratio: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget is a fraction of the plain step's allocator peak (with the parameters and the
    batch): the pool's own peak counts the bounds, more than the step holds."""
    remade: list[int] = []  # results recomputed at the size their first run made, below their count
    install = AccountingBackend._install

    def spy(self: AccountingBackend, storage: int, content: torch.UntypedStorage) -> None:
        if storage in self.made_less:
            remade.append(storage)
        install(self, storage, content)

    monkeypatch.setattr(AccountingBackend, "_install", spy)
    torch.manual_seed(0)
    model, x = _Selecting(), torch.randn(256, 128)
    _step(model, x)
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with remat.memory.track(allocator=True) as measured:
        _step(model, x)
    free = remat.dynamic(None, policy, keep=model, cost="model")
    for _ in range(2):  # the second step counts the kernels' scratch the first learned
        model.zero_grad(set_to_none=True)
        with free:
            _step(model, x)
    budget = int(ratio * (measured.peak_bytes + free.stats.outside_bytes))
    region = remat.dynamic(budget, policy, keep=model, cost="model", reserve=0.1, thrash_limit=50.0)
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran before its results could be sized")
        with remat.memory.track(allocator=True) as measured, region:
            _step(model, x)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain, strict=True))
    assert measured.peak_bytes + region.stats.outside_bytes <= budget
    assert region.stats.recomputations > 0 and remade
    comparison = region.stats.compare()
    assert comparison.same_evictions
    assert comparison.simulated_recomputations == region.stats.recomputations


def test_a_size_that_depends_on_the_data_is_not_learned_for_the_next_call() -> None:
    """A run-first op's result sizes are kept for its next call of the same signature (to place it
    ahead); for ``x[mask]`` that size was this call's data's, and a later call selecting more was
    placed too small (the arena backend runs it first, as does an index with two masks)."""
    import torch.utils._pytree as pytree

    from remat.aten import scratch

    x, mask = torch.randn(64, 8), torch.rand(64) > 0.5
    func = torch.ops.aten.index.Tensor
    out = func(x, [mask])
    key = scratch.signature_of(str(func), pytree.tree_leaves(((x, [mask]), {})))
    backend = AccountingBackend(torch.device("cpu"), 3.0)
    backend.learned(func, key, (True,), out, (out.untyped_storage().nbytes(),), (x, [mask]))
    assert scratch.results(key) is None
    plain = torch.ops.aten.mm.default
    y = plain(x.t(), x)
    other = scratch.signature_of(str(plain), [x.t(), x])
    backend.learned(plain, other, (True,), y, (y.untyped_storage().nbytes(),), (x.t(), x))
    assert scratch.results(other) == (y.untyped_storage().nbytes(),)  # a size the data does not set


class _Convs(nn.Module):
    """``nonzero`` on a 4-d activation: its bound, 32 bytes an element, is 8 times the activation."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(16, 16, 3, padding=1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.new_zeros(())
        for conv in self.convs:
            x = torch.tanh(conv(x))
            total = total + (x > 0.999).nonzero().shape[0] * 1e-4
        return x * total


def test_a_bound_that_does_not_fit_runs_the_op_first() -> None:
    """At 0.8 of the plain step's peak the bound needed more than the budget, and the step that ran
    before bounds were placed was refused ("the budget cannot hold what op 4 needs at once")."""
    torch.manual_seed(0)
    model, x = _Convs(), torch.randn(32, 16, 16, 16)
    _step(model, x)
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with remat.memory.track(allocator=True) as measured:
        _step(model, x)
    budget = int(0.8 * measured.peak_bytes)
    model.zero_grad(set_to_none=True)
    with remat.dynamic(budget, "dtr", keep=model, cost="model", reserve=0.1) as region:
        _step(model, x)
    assert region.stats.recomputations > 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain, strict=True))
