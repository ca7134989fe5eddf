"""Planned pipelines on 2 CPU processes over gloo, checked against a single-process run.

One spawn (one process group) runs every job of the module, to keep start-up cost down: GPipe,
1F1B, interleaved 1F1B and ZBV (two stages per rank, looped or in a V; under ZBV each stage runs a
micro-batch's whole backward at I and nothing at W), after the calibration of the per-action cost
(``remat.pipeline.calibrate``'s measurement, in the same processes), each under per-stage plans
made for a budget below the plain pipeline's need (GPipe's cut searched with the plans,
``balance_by="step"``), on a chain with batch norm and dropout, and
1F1B once more with every block checkpointed and ``rerun_modules=True`` on a chain without batch
norm (its blocks then run again as modules, as ``torch.utils.checkpoint`` runs them). Each
rank reports its gradients, buffers, allocator peak, the forward ops it ran (``addmm``: the
schedule's forwards and the plan's recomputations) and the order its stages ran forwards and
backwards in.

The gradients and buffers equal, bit for bit, those of a single-process run
(``remat.pipeline.launch.reference``) that runs the same actions in a dependency order with each
rank's generator: a stage's parameter gradients are sums over micro-batches, and floating-point
sums depend on their order, so the reference adds them in the order the stage's backwards run
(micro-batch 0 to M - 1 in every schedule here), each from a separate backward as on the ranks,
and scales them as torch's schedules do (``div_`` by M). Recomputation replays the same ops on
the same values with one thread, so it changes no bit. (For GPipe and 1F1B a reference that runs
micro-batch by micro-batch, each stage with its rank's generator, is already bitwise equal; under
interleaved 1F1B two stages share a rank's generator, so the dropout draws depend on the order
the rank runs its forwards in, which only replaying the schedule reproduces.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import pytest
import torch
from pipelines import Counted, assert_equal_to_one_process
from torch import nn

import remat.pipeline as pp
from remat.pipeline.chain import mlp_chain
from remat.pipeline.launch import Job, RankResult, run_calibrated
from remat.planner.plan import Plan
from remat.policy import Decision

M = 4
RANKS = 2
ROWS = 64
ADDMM = "aten.addmm.default"
# each case: its schedule, and whether blocks may run again as modules (``rerun_modules``: the
# blocks of a chain without batch norm, whose running statistics a call run again would update twice,
# qualify; those with it stay on the tape). That case checkpoints every block (``checkpoint="always"``)
# so that it runs modules again whatever the measured op times make the cheapest plan
CASES = {
    "gpipe": ("gpipe", False),
    "1f1b": ("1f1b", False),
    "interleaved-1f1b": ("interleaved-1f1b", False),
    "zbv": ("zbv", False),
    "1f1b-modules-run-again": ("1f1b", True),
}
SCHEDULES = tuple(CASES)
PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zbv": 2}
# a chain of two blocks per stage; interleaved and zbv run on a fixed cut (the memory balance finds
# one that needs no recomputation at this budget) a little above the others' share of the plain need
BUILDS = {
    (1, False): functools.partial(mlp_chain, 4, 32, 128, 0.1, True),
    (2, False): functools.partial(mlp_chain, 8, 32, 128, 0.1, True),
    (1, True): functools.partial(mlp_chain, 4, 32, 128, 0.1, False),
}
PLAIN_CUTS = {1: [2], 2: [2, 4, 6]}
SHARE = {1: 0.85, 2: 0.9}


def _recomputed(plan: Plan, name: str) -> int:
    """How many ``name`` ops the plan runs again for one micro-batch: in this chain every
    ``addmm``'s output is saved for backward by the op after it (batch norm, the next linear), so
    an ``addmm`` runs again exactly when the plan recomputes its output."""
    return len({t.op for t in plan.tensors if t.action is Decision.RECOMPUTE and t.op_name == name})


def _run_again(plan: Plan, module: nn.Module, name: str) -> int:
    """How many ``name`` ops a plan whose regions run their modules again runs again for one
    micro-batch, counted on one forward and backward in this process: such a call runs every op
    up to autograd's last save in it (``Rerun.stop``), which the plan does not list."""
    counts = []
    for planned in (False, True):
        x = torch.randn(ROWS, 32, requires_grad=True)
        with Counted(name) as counted:
            with plan.apply(module) if planned else contextlib.nullcontext():
                y = module(x)
            y.sum().backward()
        counts.append(counted.count)
    module.zero_grad(set_to_none=True)
    return counts[1] - counts[0]


@pytest.fixture(scope="module")
def spawned(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[list[tuple[pp.PipelinePlan, Job, list[RankResult]]], pp.ActionCost]:
    torch.manual_seed(0)
    x, y = torch.randn(M * ROWS, 32), torch.randn(M * ROWS, 32)
    plans: list[pp.PipelinePlan] = []
    builds = []
    plains: dict[int, pp.PipelinePlan] = {}
    for schedule, again in CASES.values():
        per_rank = PER_RANK[schedule]
        builds.append(BUILDS[per_rank, again])
        torch.manual_seed(0)
        model = builds[-1]()
        options: dict[str, Any] = dict(
            n_stages=RANKS,
            n_microbatches=M,
            schedule=schedule,
            stages_per_rank=per_rank,
            loss_fn=nn.functional.mse_loss,
            target=y[:ROWS],
            rerun_modules=again,
        )
        cuts = PLAIN_CUTS[per_rank]
        if again:
            plans.append(pp.plan(model, x[:ROWS], **options, budget_per_rank="1GB", checkpoint="always"))
            continue
        if schedule == "zbv":
            # the same cut of the same chain costs the same per stage as interleaved's: its plain
            # stages walked in zbv's order give the plain need (one planning less)
            order = pp.build(schedule, RANKS, M, per_rank)
            costs = tuple(tuple(sp.cost(i, M) for i in range(M)) for sp in plains[per_rank].stage_plans)
            need = max(pp.walk(order, costs).peak_bytes)
        else:
            plains[per_rank] = pp.plan(model, x[:ROWS], **options, budget_per_rank="1GB", boundaries=cuts)
            need = max(plains[per_rank].timeline().peak_bytes)
        budget = int(SHARE[per_rank] * need)
        fixed = cuts if per_rank > 1 else None
        # GPipe's cut is searched with its stages' plans (``balance_by="step"``), 1F1B's balanced by memory
        by = "step" if schedule == "gpipe" else "memory"
        plans.append(
            pp.plan(model, x[:ROWS], **options, budget_per_rank=budget, boundaries=fixed, balance_by=by)
        )
    jobs = [
        Job(
            build,
            p.to_json(),
            x,
            y,
            nn.functional.mse_loss,
            seed=1,
            counted=(ADDMM,),
        )
        for p, build in zip(plans, builds, strict=True)
    ]
    # the processes also measure the per-action cost, with messages of one micro-batch's activation
    results, per_action = run_calibrated(jobs, RANKS, tmp_path_factory.mktemp("gloo"), (ROWS, 32), rounds=3)
    return list(zip(plans, jobs, results, strict=True)), per_action


@pytest.fixture(scope="module")
def runs(
    spawned: tuple[list[tuple[pp.PipelinePlan, Job, list[RankResult]]], pp.ActionCost],
) -> list[tuple[pp.PipelinePlan, Job, list[RankResult]]]:
    return spawned[0]


def test_the_calibration_in_the_same_processes_measures_each_figure(spawned) -> None:
    per = spawned[1]
    figures = dataclasses.asdict(per)
    assert set(figures) == {f.name for f in dataclasses.fields(pp.ActionCost)}
    assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in figures.values())
    # a send and a receive each take CPU time on their rank, and the schedule's own work more
    assert per.send_s > 0 and per.receive_s > 0
    assert per.forward_s + per.backward_s + per.step_s > 0
    # the plans take it, and their predicted step grows by it
    plan = spawned[0][0][0]
    costed = dataclasses.replace(plan, action_cost=per)
    assert costed.timeline().makespan > plan.timeline().makespan
    assert costed.timeline().peak_bytes == plan.timeline().peak_bytes


@pytest.mark.parametrize("index", range(len(SCHEDULES)), ids=SCHEDULES)
def test_gradients_and_buffers_equal_a_single_process_run(runs, index: int) -> None:
    plan, job, results = runs[index]
    assert any(sp.plan is not None for sp in plan.stage_plans)
    if CASES[SCHEDULES[index]][1]:  # every block runs again as its module
        assert all(r.rerun for sp in plan.stage_plans if sp.plan for r in sp.plan.regions)
    assert_equal_to_one_process(job, results)


@pytest.mark.parametrize("index", range(len(SCHEDULES)), ids=SCHEDULES)
def test_each_rank_peak_within_its_budget_and_the_prediction(runs, index: int) -> None:
    """In the first step, which makes the receive buffers, and in a later one, which reuses them
    (NOTE [receive buffers] in ``remat.pipeline.timeline``)."""
    plan, _, results = runs[index]
    line = plan.timeline()
    for result in results:
        for measured, predicted in (
            (result.first_peak_bytes, line.peak_bytes[result.rank]),
            (result.peak_bytes, line.steady_peak_bytes[result.rank]),
        ):
            assert measured <= plan.budget_bytes
            assert abs(measured - predicted) <= 0.05 * predicted


@pytest.mark.parametrize("index", range(len(SCHEDULES)), ids=SCHEDULES)
def test_forwards_are_the_schedules_plus_the_planned_recomputations(runs, index: int) -> None:
    plan, _, results = runs[index]
    modules = plan.stage_modules()
    for result in results:
        expected = 0
        for sp in plan.stage_plans:
            if sp.rank == result.rank:
                linears = sum(isinstance(m, nn.Linear) for m in modules[sp.stage].modules())
                if sp.plan is None:
                    again = 0
                elif any(r.rerun for r in sp.plan.regions):
                    again = _run_again(sp.plan, modules[sp.stage], ADDMM)
                else:
                    again = _recomputed(sp.plan, ADDMM)
                expected += M * linears + sum(sp.recomputes(i, M) for i in range(M)) * again
        assert result.counts[ADDMM] == expected


@pytest.mark.parametrize("index", range(len(SCHEDULES)), ids=SCHEDULES)
def test_the_schedule_model_is_the_order_torch_runs(runs, index: int) -> None:
    plan, _, results = runs[index]
    for result in results:
        assert list(result.order) == [str(a) for a in plan.order.actions[result.rank]]


def test_the_demo_draws_its_step_and_every_rank_stays_within_the_budget(tmp_path, monkeypatch) -> None:
    """In a folder named relative to the working directory, as ``make demo`` names it (a relative
    one made the file rendezvous's URL name another file, and every rank waited for the others)."""
    from remat.pipeline.demo import demo

    monkeypatch.chdir(tmp_path)
    result = demo("out")
    assert result.picture.read_bytes()[:4] == b"\x89PNG"
    assert all(0 < peak <= result.budget_bytes for peak in result.measured)
    assert str(result).startswith("pipeline, 1f1b on 2 gloo processes")
