"""The executor's own per-op cost (NOTE [executor cost]): calibrated figures, and plans predicted
with fixed ones (the prediction's exact arithmetic is in ``test_plan_predict.py``)."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
from plans import _traced

import remat
from remat import RematValueError
from remat.planner import ExecutorCost, plan_trace
from remat.planner.executor_cost import calibrate, measured
from remat.planner.frontier import frontier
from remat.planner.offload_model import Item, Move, OffloadProblem, OffloadSchedule, backward_step, evaluate
from remat.planner.predict import predict
from remat.planner.search import best
from remat.planner.types import Chain

FIXED = ExecutorCost(check=2e-5, record=4e-5, replay=2e-5, offload=3e-4)


def test_calibration_gives_positive_finite_figures_once_per_device() -> None:
    figures = calibrate("cpu")
    # The dispatch mode's check costs several times a tiny op's kernel, far beyond the rounds' noise;
    # the other figures are differences of a few microseconds that a loaded machine may round to 0.
    assert math.isfinite(figures.check) and figures.check > 0
    for value in (figures.record, figures.replay, figures.offload):
        assert math.isfinite(value) and value >= 0
    assert measured("cpu") is measured("cpu")


def test_calibration_inside_the_callers_autocast() -> None:
    """``remat.plan`` inside ``torch.autocast`` calibrates there on its first plan of a process:
    autocast's cast cache handed the capture's weight casts to the runs after it, which then did not
    run the ops the capture traced ("the model's forward diverged"). The caller's autocast does not
    apply to the calibration now."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        figures = calibrate("cpu")
        assert torch.is_autocast_enabled("cpu")
    assert math.isfinite(figures.check) and figures.check > 0


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


def test_the_offload_model_charges_each_move_its_host_seconds() -> None:
    """Over an infinitely fast link a move costs nothing but the host's bookkeeping: ``per_move``
    seconds each, and the same peak (NOTE [offload model])."""
    n = 4
    chain = Chain.of([1.0] * n, [2.0] * n, [100] * n, [300] * n, input_bytes=100)
    items = tuple(Item(f"x{k}", k, 300, k, k, backward_step(n, k), backward_step(n, k)) for k in range(n))
    problem = OffloadProblem(chain, items, remat.Link(d2h=1e18, h2d=1e18, latency=0))
    moves = (Move(0, 1, backward_step(n, 0) - 1), Move(1, 2, backward_step(n, 1) - 1))
    schedule = OffloadSchedule(moves=moves)
    free = evaluate(problem, schedule)
    charged = evaluate(dataclasses.replace(problem, per_move=0.25), schedule)
    assert charged.total_cost == pytest.approx(free.total_cost + 0.5, rel=1e-12)
    assert (charged.peak_bytes, charged.stall) == (free.peak_bytes, free.stall) == (charged.peak_bytes, 0.0)


@pytest.mark.parametrize("device", ["tpu9", "cuda"])
def test_a_trace_of_a_device_this_machine_lacks_asks_for_the_figures(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace captured on a GPU and planned on a CPU: its device's figures cannot be measured here
    (torch's "Torch not compiled with CUDA enabled" or "Invalid device string" came out instead).
    The tests' plans leave the executor out (``conftest``); this one asks for the measured figures."""
    monkeypatch.setattr(remat.planner.frontier, "measured", measured)
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has the device")
    with pytest.raises(RematValueError, match=r"remat\.plan: the executor's per-op cost is measured"):
        measured(device)
    trace, base, low = _traced("gpt2")
    trace, budget = dataclasses.replace(trace, device=device), (low + base) // 2
    with pytest.raises(RematValueError, match=rf"this machine lacks \(got '{device}'\); pass executor_cost="):
        plan_trace(trace, budget)
    assert plan_trace(trace, budget, executor_cost=FIXED).predicted_peak_bytes <= budget
