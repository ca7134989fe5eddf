"""``remat.pipeline`` given what it was not planned for, without processes: a model whose forward is
not its children in order (a module listed twice, a skip across children), a saved plan loaded onto
another model or damaged, micro-batches of another shape, outputs torch cannot send as they are; and
the figures a refused budget names on ranks that run two stages."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from models import chain_example
from torch import nn

import remat
import remat.pipeline as pp
from remat import RematTypeError, RematValueError
from remat.pipeline.chain import mlp_chain
from remat.pipeline.execute import PlannedStage, sendable
from remat.pipeline.timeline import walk


def _plan(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **options: object) -> pp.PipelinePlan:
    settings = {"n_stages": 2, "n_microbatches": 2, "schedule": "1f1b", "budget_per_rank": "1GB"}
    settings |= {"loss_fn": nn.functional.mse_loss, "target": y, "op_costs": "model", **options}
    return pp.plan(model, x, **settings)  # type: ignore[arg-type]


class _Skip(nn.Module):
    """Children a, b; forward a(x) + b(a(x)): not the chain b(a(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h + self.b(h)


def test_a_model_whose_forward_is_not_its_children_in_order_is_refused() -> None:
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with pytest.raises(
        RematValueError, match=r"forward runs its children in order.*_Skip's forward computes"
    ):
        _plan(_Skip(), x, y)
    shared = nn.Linear(8, 8)  # listed twice: children() would list it once, and the stages skip it
    with pytest.raises(RematValueError, match=r"stages must not share a parameter"):
        _plan(nn.Sequential(shared, nn.ReLU(), shared, nn.Tanh()), x, y, boundaries=[2])
    one_stage = _plan(nn.Sequential(nn.Linear(8, 8), shared, nn.ReLU(), shared), x, y, boundaries=[1])
    assert one_stage.boundaries == (0, 1, 4)


def test_a_saved_plan_fits_only_the_model_it_was_made_for(tmp_path: Path) -> None:
    model, x, y = chain_example(64)
    plan = _plan(model, x, y, boundaries=[2])
    path = tmp_path / "plan.json"
    plan.save(path)
    bigger = nn.Sequential(*model, nn.Linear(y.shape[1], y.shape[1]))
    with pytest.raises(
        RematValueError, match=r"the model is not the one planned \(5 children for a plan of 4\)"
    ):
        pp.PipelinePlan.load(path, bigger)
    for wrong in ("abc", ["a", "b"], [model[0], 3]):
        with pytest.raises(
            RematTypeError, match=r"the model is an nn.Module, or a list of the stage modules \(got "
        ):
            pp.PipelinePlan.load(path, wrong)  # type: ignore[arg-type]
    for other, said in (  # as many children: no batch norm in them, or another width
        (mlp_chain(4, 32, 128), r"stage 0 has 8 parameters, planned 12"),
        (
            mlp_chain(4, 64, 128, batch_norm=True),
            r"stage 0's parameter 0 is of shape \[128, 64\], planned \[128, 32\]",
        ),
    ):
        with pytest.raises(RematValueError, match=rf"the model is not the one planned \({said}\)"):
            pp.PipelinePlan.load(path, other)
    body = json.loads(path.read_text())
    body["stage_plans"] = body["stage_plans"][:1]
    path.write_text(json.dumps(body))
    with pytest.raises(RematValueError, match=r"incomplete or damaged \(1 stage plans for 2 stages\)"):
        pp.PipelinePlan.load(path, model)


def test_a_micro_batch_of_another_shape_is_refused_before_it_is_sent() -> None:
    model, x, y = chain_example(64)
    plan = _plan(model, x, y, boundaries=[2])
    first = PlannedStage(plan.stage_modules()[0], plan.stage_plans[0], 2)
    first(x)  # the micro-batch planned
    with pytest.raises(RematValueError, match=r"micro-batch has the shape and dtype the plan was made for"):
        first(x[:31])


def test_a_stage_put_in_eval_mode_runs_plainly_with_grad_enabled() -> None:
    """torch's ``schedule.eval`` runs the stages with grad enabled: the plan, traced in training
    (batch norm updating its statistics), was applied to the eval forward and refused it."""
    model, x, y = chain_example(64)
    plan = _plan(model, x, y, boundaries=[2], checkpoint="always")
    first = PlannedStage(plan.stage_modules()[0], plan.stage_plans[0], 2)
    assert plan.stage_plans[0].plan is not None
    model.eval()
    expected = plan.stage_modules()[0](x)
    assert torch.equal(first(x), expected)
    model.train()
    first(x).sum().backward()  # under the plan again


def test_an_output_torch_cannot_send_as_it_is_is_made_contiguous() -> None:
    t = torch.randn(4, 6)
    assert sendable(t) is t
    assert sendable(t.t()).is_contiguous() and torch.equal(sendable(t.t()), t.t())


class _Transposed(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x)).transpose(1, 2)


def test_a_stage_that_returns_a_tensor_that_is_not_contiguous_is_told() -> None:
    """Sent as a contiguous copy, it reaches the next stage in another layout than one process
    passes on: a bias gradient there differed by 4e-9 from a single process's, with no word."""
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    model = nn.Sequential(_Transposed(16, 16), _Transposed(8, 8), nn.Linear(16, 16))
    told = r"remat\.pipeline\.plan: stage 0 returns a tensor that is not contiguous .* \.contiguous\(\)"
    with pytest.warns(UserWarning, match=told):
        _plan(model, x, y, boundaries=[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transposes inside a stage are sent nowhere
        _plan(nn.Sequential(*model, nn.Linear(16, 16)), x, y, boundaries=[3])


def test_a_refused_budget_names_each_ranks_peak_where_ranks_run_two_stages() -> None:
    model, x, y = chain_example(64)
    options = {"schedule": "interleaved-1f1b", "stages_per_rank": 2, "checkpoint": "never"}
    plan = _plan(model, x, y, **options)
    m = plan.order.n_microbatches
    peaks = walk(
        plan.order, tuple(tuple(sp.cost(i, m) for i in range(m)) for sp in plan.stage_plans)
    ).peak_bytes
    with pytest.raises(RematValueError) as refused:
        _plan(model, x, y, **options, budget_per_rank=min(peaks) - 1)
    named = [int(n) for n in re.findall(r"rank \d+ needs (\d+) bytes", str(refused.value))]
    assert named == list(peaks)


def test_a_stage_holds_its_output_until_its_backward() -> None:
    """torch's stage keeps the output until the micro-batch's backward has run; a ReLU saves it and
    the traced step used to let it go midway through the backward (one output short)."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    plan = _plan(nn.Sequential(*stage, nn.Linear(256, 256)), x, y, boundaries=[4])
    first = plan.stage_plans[0]
    with remat.memory.track(timeline=False, allocator=True) as tracked:
        out = stage(x)
        out.sum().backward()
        del out
    assert tracked.peak_bytes <= first.plain_peak_bytes


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def test_stages_with_nothing_to_differentiate_or_no_tensor_to_send_are_refused() -> None:
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    frozen = nn.Linear(8, 8).requires_grad_(False)
    with pytest.raises(RematValueError, match=r"every stage has something to differentiate.*stage 0 has no"):
        _plan(nn.Sequential(frozen, nn.Linear(8, 8)), x, y, boundaries=[1])
    with pytest.raises(remat.RematTypeError, match=r"returns one tensor, the next child's input"):
        _plan([_Pair(), nn.Linear(8, 8)], x, y)  # type: ignore[arg-type]


class _CheckpointedInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def inner(t: torch.Tensor) -> torch.Tensor:
            return self.b(nn.functional.dropout(torch.tanh(self.a(t)), 0.1))

        return torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False)


def test_a_stages_later_steps_count_the_memory_no_op_made() -> None:
    """A stage that checkpoints inside copies the random-number state (NOTE [unseen bytes] in
    ``remat.trace.types``) in every step, not only in the first one the planner measured."""
    from remat.pipeline.measure import measure
    from remat.pipeline.schedule import build

    torch.manual_seed(0)
    x = torch.randn(8, 32)
    order = build("1f1b", 2, 2, 1, api="pipeline.plan")
    _, first, _, later = measure(order, 0, _CheckpointedInside(), x, x, nn.functional.mse_loss, "model")
    assert later is not None and first.unseen_bytes > 0
    assert later.unseen_bytes == first.unseen_bytes
