"""``remat.pipeline.plan(..., schedule="zbv")`` without processes: two stages per rank in a V, the
micro-batches each holds, the JSON form, the per-rank table and the picture (the gloo run is in
test_pipeline_gloo)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from models import chain_example
from torch import nn

import remat.pipeline as pp
from remat import RematValueError
from remat.pipeline.picture import draw

ROWS, M = 64, 4


@pytest.fixture(scope="module")
def example() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return chain_example(ROWS)


def _plan(example, budget, **options) -> pp.PipelinePlan:
    model, x, y = example
    return pp.plan(
        model,
        x,
        n_stages=2,
        n_microbatches=M,
        schedule="zbv",
        budget_per_rank=budget,
        loss_fn=nn.functional.mse_loss,
        target=y,
        boundaries=[1, 2, 3],
        op_costs="model",  # the cost model's op times: one traced step per stage, not three timed
        **options,
    )


@pytest.fixture(scope="module")
def plan(example) -> pp.PipelinePlan:
    return _plan(example, "1GB")


def test_a_zbv_plan_places_its_stages_in_a_v_and_saves_and_loads(example, plan, tmp_path: Path) -> None:
    model, _, _ = example
    p = plan
    assert p.order.name == "zbv" and p.order.n_stages == 4
    assert [sp.rank for sp in p.stage_plans] == [0, 1, 1, 0]
    assert [sp.in_flight for sp in p.stage_plans] == [4, 3, 2, 1]
    p.save(tmp_path / "plan.json")
    loaded = pp.PipelinePlan.load(tmp_path / "plan.json", model)
    assert loaded == p and loaded.order.stages_of(0) == (0, 3)
    assert loaded.timeline() == p.timeline()


def test_a_zbv_plan_explains_and_draws_its_split_backward(plan, tmp_path: Path) -> None:
    p = plan
    out = io.StringIO()
    p.explain(file=out)
    assert "predicted step" in out.getvalue() and "(zbv)" in out.getvalue()
    draw(p, tmp_path / "zbv.png")
    assert (tmp_path / "zbv.png").read_bytes()[:4] == b"\x89PNG"
    kinds = {s.action.kind for s in p.timeline().spans}
    assert kinds == {"F", "I", "W"}


def test_zbv_runs_two_stages_per_rank_only(example) -> None:
    with pytest.raises(
        RematValueError,
        match=r"remat\.pipeline\.plan: zbv runs exactly two stages per rank, in a V \(stages_per_rank=3\)",
    ):
        _plan(example, "1GB", stages_per_rank=3)


def test_zbv_on_a_torch_without_its_schedule_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import pipelining

    from remat.pipeline.execute import torch_schedule

    monkeypatch.delattr(pipelining, "ScheduleZBVZeroBubble")
    with pytest.raises(RematValueError, match=r"zbv schedule needs .*ZeroBubble.*torch 2\.6 or later"):
        torch_schedule("zbv", [], 4, nn.functional.mse_loss)
