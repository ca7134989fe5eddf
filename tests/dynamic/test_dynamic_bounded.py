"""Ops whose result's size depends on the data (``nonzero``, ``masked_select``, ``x[mask]``) are
placed at the most they can make before they run (NOTE [bounded ops] in
``remat.dynamic.sizing``): the budget holds in the allocator's count whatever the data, where they
ran first and passed it by what the reserve lacked (with a warning to raise it)."""

from __future__ import annotations

import warnings

import pytest
import torch
from budgeted import budgeted_step
from torch import nn

from remat.dynamic.accounting import AccountingBackend


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


@pytest.mark.parametrize("ratio", [0.8, 0.65])
@pytest.mark.parametrize("policy", ["dtr", "coop"])
def test_data_dependent_sizes_hold_the_budget(
    policy: str, ratio: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    remade: list[int] = []  # results recomputed at the size their first run made, below their count
    install = AccountingBackend._install

    def spy(self: AccountingBackend, storage: int, content: torch.UntypedStorage) -> None:
        if storage in self.made_less:
            remade.append(storage)
        install(self, storage, content)

    monkeypatch.setattr(AccountingBackend, "_install", spy)
    torch.manual_seed(0)
    model, x = _Selecting(), torch.randn(256, 128)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran before its results could be sized")
        run = budgeted_step(model, x, policy, ratio, free_cost="model", thrash_limit=50.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), run.plain, strict=True))
    assert run.allocator_peak + run.stats.outside_bytes <= run.budget
    assert run.stats.recomputations > 0 and remade
    comparison = run.stats.compare()
    assert comparison.same_evictions
    assert comparison.simulated_recomputations == run.stats.recomputations


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
