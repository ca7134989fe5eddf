"""``remat plan``: explain a plan, save it, and sweep a Pareto curve with measured points."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from plans import trace_with_fixed_costs

import remat
from remat import Plan
from remat.cli import main
from remat.planner.cli import _in_flags


def test_plan_explains_and_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace_with_fixed_costs(monkeypatch)  # which plan auto picks (chain's) must not depend on op timings
    path = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt2", "--batch", "4", "--seq", "16", "--budget", "0.8"]
    assert main([*args, "--save", str(path)]) == 0
    out = capsys.readouterr().out
    assert "transformer.h.0" in out and "recomputed" in out
    plan = Plan.load(path)
    assert plan.solver == "chain" and plan.regions


def test_budget_min_plans_at_the_minimum_a_refusal_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace_with_fixed_costs(monkeypatch)  # both runs capture the same op costs, so the same minimum
    args = ["plan", "--model", "gpt2", "--batch", "4", "--seq", "16"]
    assert main([*args, "--budget", "100"]) == 2
    err = capsys.readouterr().err
    found = re.search(r"the minimum is (\d+) bytes", err)
    assert found is not None, err
    path = tmp_path / "plan.json"
    assert main([*args, "--budget", "min", "--save", str(path)]) == 0
    plan = Plan.load(path)
    assert plan.budget_bytes == plan.predicted_peak_bytes == int(found.group(1))


def test_rerun_modules_flag_reaches_the_planner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--rerun-modules`` plans as ``remat.plan(..., rerun_modules=True)`` (which plan wins depends
    on the executor's calibrated cost, so the test follows the flag, not one plan)."""
    import remat.planner.api as api

    trace_with_fixed_costs(monkeypatch)
    asked: list[bool] = []
    planned = api.plan_trace

    def spy(*args: Any, **kwargs: Any) -> Plan:
        asked.append(kwargs["rerun_modules"])
        return planned(*args, **kwargs)

    monkeypatch.setattr(api, "plan_trace", spy)
    args = ["plan", "--model", "gpt2", "--batch", "4", "--seq", "16", "--budget", "0.6"]
    assert main([*args, "--save", str(tmp_path / "a.json")]) == 0
    assert main([*args, "--rerun-modules", "--save", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    assert asked == [False, True]
    assert not any(r.rerun for r in Plan.load(tmp_path / "a.json").regions)
    for region in Plan.load(tmp_path / "b.json").regions:  # an MLP region that keeps nothing runs again
        if re.fullmatch(r"transformer\.h\.\d+\.mlp", region.name) and not region.save:
            assert region.rerun == region.name


def test_pareto_spans_the_feasible_range_and_measures(tmp_path: Path) -> None:
    """The sweep's budgets run from the smallest feasible peak to the plain peak; every solver has a
    plan at the plain peak, and more budget never gives a costlier one."""
    data, png = tmp_path / "p.json", tmp_path / "p.png"
    args = ["plan", "--model", "gpt2", "--batch", "4", "--seq", "16", "--pareto", "--points", "3"]
    assert (
        main([*args, "--solvers", "chain,sqrt", "--repeats", "1", "--json", str(data), "--out", str(png)])
        == 0
    )
    points = json.loads(data.read_text())["points"]
    assert {p["solver"] for p in points} == {"chain", "sqrt"}
    budgets = sorted({p["budget"] for p in points})
    assert len(budgets) == 3 and budgets[-1] == max(p["predicted_peak"] for p in points)
    assert min(p["predicted_peak"] for p in points) == budgets[0]
    for p in points:
        assert p["predicted_peak"] <= p["budget"]
        assert p["measured_peak"] == pytest.approx(p["predicted_peak"], rel=0.05)
    for solver in ("chain", "sqrt"):
        mine = sorted((p for p in points if p["solver"] == solver), key=lambda p: p["budget"])
        assert mine[-1]["budget"] == budgets[-1] and mine[-1]["predicted_overhead"] == 1.0
        overheads = [p["predicted_overhead"] for p in mine]
        assert overheads == sorted(overheads, reverse=True)
    assert png.stat().st_size > 10_000


def test_points_must_be_at_least_two(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "gpt2", "--pareto", "--points", "1"])
    assert exit_info.value.code == 2
    assert "remat.plan: --points must be a whole number of at least 2 (got '1')" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args", [["--out", "never.png"], ["--json", "never.json"], ["--pareto", "--save", "never.json"]]
)
def test_an_output_the_command_would_not_write_is_refused(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out`` and ``--json`` without ``--pareto`` exited 0 and wrote nothing."""
    assert main(["plan", "--model", "gpt2", *args]) == 2
    assert capsys.readouterr().err.startswith(
        "remat.plan: --out and --json go with --pareto, --save without it"
    )


def test_a_sweep_with_nowhere_to_go_is_refused_before_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``--pareto`` without ``--out`` or ``--json`` planned and measured every point, then wrote
    nothing and exited 0."""
    assert main(["plan", "--model", "gpt2", "--pareto"]) == 2
    assert capsys.readouterr().err.startswith("remat.plan: --pareto writes its sweep to --out")


def test_a_host_budget_without_a_link_is_refused_before_the_step_is_traced(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It was refused after tracing, with the Python API's advice ("pass link=remat.Link(...)")."""
    assert main(["plan", "--model", "gpt2", "--host-budget", "1GB"]) == 2
    assert capsys.readouterr().err.startswith(
        "remat.plan: --host-budget bounds what goes to the host over --link"
    )


@pytest.mark.parametrize(
    ("args", "given"),
    [
        (["--points", "3"], "--points without --pareto"),
        (["--solvers", "chain", "--repeats", "2"], "--solvers --repeats without --pareto"),
        (["--pareto", "--json", "never.json", "--solver", "chain"], "--solver with --pareto"),
    ],
)
def test_a_flag_of_the_other_form_is_refused_not_ignored(
    args: list[str], given: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--points``, ``--solvers`` and ``--repeats`` without ``--pareto`` (and ``--solver`` with it)
    were ignored in silence; now refused before the model is built."""
    built = []
    monkeypatch.setattr(remat.zoo, "build", lambda *a, **k: built.append(a))
    assert main(["plan", "--model", "gpt2", *args]) == 2
    assert capsys.readouterr().err.startswith(
        f"remat.plan: --solver picks the plan's solver; --points, --solvers and --repeats shape the "
        f"--pareto sweep (got {given})"
    )
    assert not built


def test_a_solvers_advice_names_the_commands_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """The planner's advice came in the Python API's words ("solver='auto'", "pass link=...")."""
    assert main(["plan", "--model", "gpt2", "--solver", "offload_greedy", "--budget", "0.3"]) == 2
    assert capsys.readouterr().err.startswith(
        "remat.plan: offload needs a link model (--solver offload_greedy without --link); pass --link 25GB/s"
    )
    assert _in_flags(
        "solver 'milp' itself reaches 9 bytes at least (solver='auto' reaches the minimum); raise the "
        "budget or host_budget"
    ) == (
        "solver 'milp' itself reaches 9 bytes at least (--solver auto reaches the minimum); raise the "
        "budget or --host-budget"
    )
