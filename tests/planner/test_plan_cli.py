"""``remat plan``: explain a plan, save it, and sweep a Pareto curve with measured points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plans import trace_with_fixed_costs

from remat import Plan
from remat.cli import main


def test_plan_explains_and_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace_with_fixed_costs(monkeypatch)  # which plan auto picks (chain's) must not depend on op timings
    path = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt2", "--tiny", "--batch", "4", "--seq", "16", "--budget", "0.8"]
    assert main([*args, "--save", str(path)]) == 0
    out = capsys.readouterr().out
    assert "transformer.h.0" in out and "recomputed" in out
    plan = Plan.load(path)
    assert plan.solver == "chain" and plan.regions


def test_pareto_sweeps_solvers_and_measures(tmp_path: Path) -> None:
    data, png = tmp_path / "p.json", tmp_path / "p.png"
    args = ["plan", "--model", "gpt2", "--tiny", "--batch", "4", "--seq", "16", "--pareto"]
    assert (
        main(
            [*args, "--ratios", "0.9,0.8", "--solvers", "chain,sqrt", "--repeats", "1"]
            + ["--json", str(data), "--out", str(png)]
        )
        == 0
    )
    points = json.loads(data.read_text())["points"]
    assert {p["solver"] for p in points} == {"chain", "sqrt"}
    for p in points:
        assert p["predicted_peak"] <= p["budget"]
        assert p["measured_peak"] == pytest.approx(p["predicted_peak"], rel=0.05)
        assert p["measured_peak"] < p["plain_peak"]
    assert png.stat().st_size > 10_000
