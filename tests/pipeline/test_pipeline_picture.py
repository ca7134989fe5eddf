"""The pipeline picture (``remat.pipeline.picture.draw``): a bar per action on each rank's row,
recomputation drawn over the start of the actions that run it, per-rank memory panels with the
budget; checked on the returned figure's artists, not only on the PNG written."""

from __future__ import annotations

import matplotlib.colors
import pytest
import torch
from torch import nn

import remat.pipeline as pp
from remat.pipeline.chain import mlp_chain
from remat.pipeline.picture import _COLOURS, draw

M = 4


def _plan(checkpoint: str) -> pp.PipelinePlan:
    torch.manual_seed(0)
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    return pp.plan(
        mlp_chain(4, 16, 64),
        x,
        n_stages=2,
        n_microbatches=M,
        budget_per_rank="1GB",
        loss_fn=nn.functional.mse_loss,
        target=y,
        checkpoint=checkpoint,
        op_costs="model",
        boundaries=[2],
    )


def _bars(fig, colour: str) -> list[tuple[float, float, float]]:  # type: ignore[no-untyped-def]
    """(x, width, y) of each bar of ``colour`` on the schedule's axes."""
    top = fig.axes[0]
    rgba = matplotlib.colors.to_rgba(colour)
    found = []
    for collection in top.collections:
        if tuple(collection.get_facecolor()[0]) != rgba:
            continue
        for path in collection.get_paths():
            xs, ys = path.vertices[:, 0], path.vertices[:, 1]
            found.append((float(xs.min()), float(xs.max() - xs.min()), float(ys.min())))
    return found


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_recomputation_is_drawn_where_and_as_long_as_the_model_runs_it(tmp_path, checkpoint: str) -> None:
    plan = _plan(checkpoint)
    fig = draw(plan, tmp_path / "pipeline.png", measured=[1, 2])
    assert (tmp_path / "pipeline.png").read_bytes()[:4] == b"\x89PNG"
    spans = [s for s in plan.timeline().spans if s.recompute_s > 0]
    expected = sorted(
        (s.start * 1e3, s.recompute_s * 1e3, plan.order.n_ranks - 1 - s.rank - 0.4) for s in spans
    )
    drawn = sorted(_bars(fig, _COLOURS["recompute"]))
    assert (
        len(drawn) == len(expected) == {"always": 2 * M, "except_last": 2 * (M - 1), "never": 0}[checkpoint]
    )
    for got, want in zip(drawn, expected, strict=True):
        assert got == pytest.approx(want)
    forwards = [s for s in plan.timeline().spans if s.action.kind == "F"]
    assert len(_bars(fig, _COLOURS["F"])) == len(forwards) == 2 * M
    for rank, panel in enumerate(fig.axes[1:]):
        levels = {round(line.get_ydata()[0], 9) for line in panel.lines if len(set(line.get_ydata())) == 1}
        assert round(plan.budget_bytes / 2**20, 9) in levels and round((rank + 1) / 2**20, 9) in levels
