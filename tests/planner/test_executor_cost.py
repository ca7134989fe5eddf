"""The executor's own per-op cost (NOTE [executor cost]): calibrated figures, and plans predicted
with fixed ones (the prediction's exact arithmetic is in ``test_plan_predict.py``)."""

from __future__ import annotations

import io
import math

import pytest
from plans import _traced

from remat import RematValueError
from remat.planner import ExecutorCost, plan_trace
from remat.planner.executor_cost import calibrate, measured
from remat.planner.frontier import frontier
from remat.planner.predict import predict
from remat.planner.search import best

FIXED = ExecutorCost(check=2e-5, record=4e-5, replay=2e-5, offload=3e-4)


def test_calibration_gives_positive_finite_figures_once_per_device() -> None:
    figures = calibrate("cpu")
    for value in (figures.check, figures.record, figures.replay, figures.offload):
        assert math.isfinite(value) and value > 0
    assert measured("cpu") is measured("cpu")


def test_a_figure_must_be_finite_and_not_negative() -> None:
    for bad in ({"check": -1e-6}, {"replay": math.inf}, {"offload": math.nan}):
        with pytest.raises(RematValueError, match=r"remat.plan: an executor cost is a finite number"):
            ExecutorCost(**bad)


def test_a_plan_predicts_its_executor_share_exactly() -> None:
    """The same plan (its regions fixed by a budget) is predicted with and without the figures: its
    predicted overhead grows by exactly the executor's seconds for the work the plan does ÷ the
    plain step's, and ``explain()`` names that share."""
    trace, base, low = _traced("gpt2")
    budget = (low + base) // 2
    plain = plan_trace(trace, budget, executor_cost=ExecutorCost())
    timed = plan_trace(trace, budget, executor_cost=FIXED)
    assert plain.predicted_executor_overhead == 0.0
    found = frontier(trace, executor_cost=FIXED)
    chosen = best([c for c in found.candidates if c.pred.peak_bytes <= budget])
    assert chosen.pred.work.replayed > 0
    again = predict(trace, [r for _, r in chosen.regions], executor=ExecutorCost())
    seconds = FIXED.seconds(chosen.pred.work)
    assert chosen.pred.overhead == pytest.approx(again.overhead + seconds / again.base_cost, rel=1e-9)
    assert timed.predicted_overhead == pytest.approx(chosen.pred.overhead, rel=1e-9)
    assert timed.predicted_executor_overhead == pytest.approx(seconds / again.base_cost, rel=1e-9)
    out = io.StringIO()
    timed.explain(file=out)
    assert f"+{timed.predicted_executor_overhead:.3f} of the predicted overhead" in out.getvalue()
