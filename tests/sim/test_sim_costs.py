"""A trace with no measured costs (taken on fake tensors) is simulated on the cost model's
estimates, and says so; a stopped run shows no overhead; the sweep's picture marks the runs that did
not finish."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from remat.sim.plot import plot_sweep  # noqa: E402
from remat.sim.result import Outcome  # noqa: E402
from remat.sim.simulate import simulate, sweep  # noqa: E402
from remat.sim.synthetic import training_step  # noqa: E402
from remat.trace.cost import costed, op_cost  # noqa: E402
from remat.trace.types import Op, Trace  # noqa: E402


def _unmeasured(trace: Trace) -> Trace:
    """``trace`` as a capture on fake tensors leaves it: every op's measured cost 0."""
    events = tuple(dataclasses.replace(e, cost=0.0) if isinstance(e, Op) else e for e in trace.events)
    return dataclasses.replace(trace, events=events)


def test_a_trace_without_measured_costs_runs_on_estimates() -> None:
    trace = _unmeasured(training_step(8))
    priced, costs = costed(trace)
    assert costs == "estimated" and costed(training_step(8))[1] == "measured"
    assert [op.cost for op in priced.ops] == [op_cost(op, trace.tensors) for op in trace.ops]
    result = simulate(trace, 0.5, "dtr", thrash_limit=100.0)
    assert result.outcome is Outcome.OK and result.recomputations > 0
    assert result.costs == "estimated" and result.overhead > 1.0
    assert "estimated costs" in str(result)
    # the policies see costs, so cost-aware and cost-blind ones no longer tie
    assert simulate(trace, 0.5, "largest", thrash_limit=100.0).overhead != result.overhead


def test_a_thrashed_run_shows_no_overhead() -> None:
    trace = training_step(8)
    results = [simulate(trace, ratio, "dtr", thrash_limit=1.01) for ratio in (0.4, 0.5)]
    thrashed = [r for r in results if r.outcome is Outcome.THRASHED]
    assert thrashed
    assert all("overhead" not in str(r) and "thrashed" in str(r) for r in thrashed)


def test_the_sweep_picture_marks_runs_that_did_not_finish(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    trace = training_step(8)
    results = sweep([trace], ["dtr", "coop"], [0.05, 0.5, 0.9], thrash_limit=1.5)
    assert {r.outcome for r in results} >= {Outcome.OK, Outcome.OOM}
    drawn: list[object] = []
    real = plt.Axes.scatter

    def scatter(self: plt.Axes, x: list[float], *args: object, **kwargs: object) -> object:
        drawn.extend((marker, ratio) for ratio in x for marker in [kwargs["marker"]])
        return real(self, x, *args, **kwargs)

    plt.Axes.scatter = scatter  # type: ignore[method-assign]
    try:
        plot_sweep(results, tmp_path / "sweep.png")
    finally:
        plt.Axes.scatter = real  # type: ignore[method-assign]
    assert (tmp_path / "sweep.png").stat().st_size > 0
    failed = sorted(
        ("x" if r.outcome is Outcome.THRASHED else "v", r.ratio)
        for r in results
        if r.outcome is not Outcome.OK
    )
    assert sorted(drawn) == failed
