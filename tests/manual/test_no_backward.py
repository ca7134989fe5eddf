"""A step whose loss never reaches backward (a skipped non-finite loss, an error between forward and
backward, a forward for logging with grad on) leaves nothing behind under remat's regions and plans
(NOTE [kept detached] in ``remat.manual.scope``): the graph, the kept tensors and the region go
together, as in plain PyTorch."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
from plans import trace_with_fixed_costs

import remat
from remat.planner.cost_model import ExecutorCost


def _held_after(forward: Callable[[], None], repeats: int = 5) -> int:
    forward()
    gc.collect()
    with remat.memory.track(allocator=True, timeline=False) as measured:
        for _ in range(repeats):
            forward()
        gc.collect()
    return measured.current_bytes


@pytest.mark.parametrize("kept", ["nothing", "aten.tanh", "aten.addmm"])
def test_a_scope_whose_loss_is_dropped_holds_nothing(kept: str) -> None:
    """Kept outputs closed a cycle through autograd's C++ objects: 16 KiB held per dropped step."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))
    x = torch.randn(2, 16, 32)
    policy = None if kept == "nothing" else remat.SaveOps(frozenset({kept}))

    def forward() -> None:
        with remat.scope(policy=policy):
            h = mlp(x)
        h.sum()  # never backwarded

    assert _held_after(forward) == 0


def test_a_planned_step_skipped_before_backward_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan whose region keeps an op's output (auto's plan for a tiny GPT-2 at 0.85, on fixed op
    and executor costs, so that the plan does not depend on how busy the machine is): each skipped
    step stayed in memory (87,616 bytes each, growing without end)."""
    import transformers

    trace_with_fixed_costs(monkeypatch)

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    executor = ExecutorCost(check=2e-5, record=4e-5, replay=2e-5, offload=3e-4)
    plan = remat.plan(
        model, batch, budget=0.85, loss_fn=lambda m, **kw: m(**kw).loss, repeats=1, executor_cost=executor
    )
    assert any(region.save for region in plan.regions), "the plan keeps no output: nothing is tested"

    def forward() -> None:
        with plan.apply(model):
            loss = model(**batch).loss
        assert loss.ndim == 0  # then skipped: a non-finite loss, say

    assert _held_after(forward) == 0
    torch.manual_seed(2)  # the same dropout
    with plan.apply(model):  # and the plan still trains, as plainly
        model(**batch).loss.backward()
    planned = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    model(**batch).loss.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), planned, strict=True))
