"""``balance_by="step"``: the cut searched together with each stage's plan (``remat.pipeline.cut_search``):
never a longer predicted step than any other cut planned at the same budget, a plan where the
balanced cuts are refused, the descent's local optimum on long chains, and the cuts no stage may
take (tied parameters, a module that writes its input)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat.pipeline as pp
import remat.pipeline.cut_search as cut_search
from remat import RematValueError
from remat.pipeline.chain import mlp_chain

M = 4


def _options(y: torch.Tensor, **more: Any) -> dict[str, Any]:
    return {
        "n_stages": 3,
        "n_microbatches": M,
        "loss_fn": nn.functional.mse_loss,
        "target": y,
        "op_costs": "model",  # the same op costs on every run: the same cut
        **more,
    }


@pytest.fixture(scope="module")
def chain() -> tuple[nn.Module, torch.Tensor, torch.Tensor, int]:
    """6 MLP blocks and a budget: the largest rank need of per-block checkpointing cut evenly."""
    torch.manual_seed(0)
    model, x, y = mlp_chain(6, 32, 128), torch.randn(64, 32), torch.randn(64, 32)
    always = pp.plan(model, x, budget_per_rank="1GB", boundaries=[2, 4], checkpoint="always", **_options(y))
    return model, x, y, max(always.timeline().peak_bytes)


def _makespan(model: nn.Module, x: torch.Tensor, y: torch.Tensor, budget: int, **more: Any) -> float | None:
    try:
        return pp.plan(model, x, budget_per_rank=budget, **_options(y, **more)).timeline().makespan
    except RematValueError:
        return None


def test_the_searched_cut_is_no_slower_than_any_cut_at_the_same_budget(chain) -> None:
    model, x, y, budget = chain
    found = pp.plan(model, x, budget_per_rank=budget, **_options(y, balance_by="step"))
    assert found.balance == "step"
    assert max(found.timeline().peak_bytes) <= budget
    steps = {
        (a, b): _makespan(model, x, y, budget, boundaries=[a, b])
        for a in range(1, 5)
        for b in range(a + 1, 6)
    }
    fitting = {cut: s for cut, s in steps.items() if s is not None}
    assert fitting  # several cuts fit, and the search has the shortest step of them all
    assert found.timeline().makespan == min(fitting.values())
    assert steps[found.boundaries[1], found.boundaries[2]] == found.timeline().makespan
    for by in ("time", "memory"):
        balanced = _makespan(model, x, y, budget, balance_by=by)
        assert balanced is None or found.timeline().makespan <= balanced


def test_the_search_plans_where_the_balanced_cuts_are_refused(chain) -> None:
    """At a budget the memory-balanced cut cannot meet under any plan, another cut can: the search
    finds it; a budget no cut meets names, for the cut needing least, what each rank needs."""
    model, x, y, budget = chain
    lowest = None
    for tight in range(budget, budget // 2, -budget // 40):
        if _makespan(model, x, y, tight, balance_by="memory") is None:
            lowest = _makespan(model, x, y, tight, balance_by="step")
            if lowest is not None:
                break
    assert lowest is not None, "no budget where the balanced cut is refused and another fits"
    with pytest.raises(
        RematValueError,
        match=r"budget_per_rank below what some rank needs .*rank 0 needs \d+ bytes.*rank 2 needs \d+ bytes.*"
        r"the one needing least beyond the budget\)\); raise budget_per_rank, or use more stages",
    ):
        pp.plan(model, x, budget_per_rank=1000, **_options(y, balance_by="step"))


def test_a_long_chain_is_searched_by_descent_to_a_local_optimum(chain, monkeypatch) -> None:
    """With more cuts than ``EXHAUSTIVE`` the search moves one boundary at a time: no cut one move
    away has a shorter step, and the result is no slower than the even cut, one it starts from."""
    model, x, y, budget = chain
    monkeypatch.setattr(cut_search, "EXHAUSTIVE", 0)
    found = pp.plan(model, x, budget_per_rank=budget, **_options(y, balance_by="step"))
    a, b = found.boundaries[1:-1]
    for near in ((a - 1, b), (a + 1, b), (a, b - 1), (a, b + 1)):
        if 0 < near[0] < near[1] < 6:
            step = _makespan(model, x, y, budget, boundaries=list(near))
            assert step is None or step >= found.timeline().makespan
    even = _makespan(model, x, y, budget, boundaries=[2, 4])
    assert even is not None and found.timeline().makespan <= even


def test_no_stage_starts_where_none_may() -> None:
    """Tied parameters stay in one stage (a chain whose ties span every cut is refused as the
    balanced cut is), and no stage starts with a module that writes its input."""
    torch.manual_seed(0)
    first, second = nn.Linear(16, 16), nn.Linear(16, 16)
    second.weight = first.weight
    tied = nn.Sequential(first, second, nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    plan = pp.plan(tied, x, budget_per_rank="1GB", **_options(y, balance_by="step"))
    assert 1 not in plan.boundaries
    ends = nn.Linear(16, 16)
    spanning = nn.Sequential(ends, nn.Tanh(), nn.Linear(16, 16), ends)
    with pytest.raises(RematValueError, match=r"stages must not share a parameter"):
        pp.plan(spanning, x, budget_per_rank="1GB", **_options(y, n_stages=2, balance_by="step"))
    writes = nn.Sequential(
        nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16)
    )
    plan = pp.plan(writes, x, budget_per_rank="1GB", **_options(y, balance_by="step"))
    assert not any(isinstance(writes[k], nn.ReLU) for k in plan.boundaries[1:-1])


def test_several_stages_per_rank_are_refused_with_what_to_do(chain) -> None:
    model, x, y, _ = chain
    with pytest.raises(
        RematValueError,
        match=r"balance_by='step' searches cuts with one stage per rank .*\(6 stages on 3 ranks\); "
        r"pass balance_by='time' or 'memory', or fix the cut with boundaries=",
    ):
        pp.plan(
            model,
            x,
            budget_per_rank="1GB",
            **_options(
                y, balance_by="step", schedule="interleaved-1f1b", stages_per_rank=2, n_microbatches=6
            ),
        )


@pytest.mark.parametrize("balance_by", ["memory", "time", "step"])
def test_a_chain_whose_first_module_writes_its_input_leaves_the_example_as_it_was(balance_by: str) -> None:
    """Profiling the children, tracing the first stage and (searching) running the chain wrote the
    caller's example each time; the search weighs a cut whose first stage has nothing to
    differentiate (the in-place ReLU alone) as one that cannot run, and takes another."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    before = x.clone()
    plan = pp.plan(model, x, budget_per_rank="1GB", **_options(y, n_stages=2, balance_by=balance_by))
    assert torch.equal(x, before)
    assert plan.boundaries[1] > 1
