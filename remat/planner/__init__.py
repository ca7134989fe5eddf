"""Static planning: from one traced training step and a byte budget to the cheapest recomputation plan.

A captured step (``remat.trace``) is lowered to a problem (``remat.planner.lowering``), a ``Chain``
of blocks (``chain_from_trace``) or a ``Dag`` of ops (``dag_from_trace``); a solver from
``remat.planner.solvers`` turns it into a ``Solution``: per stage or saved node, SAVE or RECOMPUTE
(``remat.policy.Decision``), with the schedule and the predicted peak and overhead under the
planner's cost model (``schedule_cost``). ``plan`` (``remat.plan``) wraps it all for a live model:
capture, solve, check the plan on the captured step (``predict``) and return a ``Plan`` that
``Plan.apply`` runs (``remat.planner.execute``).
"""

from remat.planner import solvers
from remat.planner.api import BudgetTooSmall, plan, plan_trace, trace_step
from remat.planner.cost_model import ExecutorCost, ExecutorWork, ScheduleCost, schedule_cost
from remat.planner.lowering import chain_from_trace, coarsen, dag_from_trace, stage_key
from remat.planner.plan import Plan
from remat.planner.predict import Prediction, predict
from remat.planner.regions import Region, TensorDecision
from remat.planner.solvers import solve
from remat.planner.types import (
    BackwardStep,
    Chain,
    ChainOp,
    ChainSchedule,
    ChainStep,
    Dag,
    DagSchedule,
    DagStage,
    Node,
    Problem,
    Schedule,
    Solution,
    SolverDecision,
    Stage,
)

__all__ = [
    "BackwardStep",
    "BudgetTooSmall",
    "Chain",
    "ChainOp",
    "ChainSchedule",
    "ChainStep",
    "Dag",
    "DagSchedule",
    "DagStage",
    "ExecutorCost",
    "ExecutorWork",
    "Node",
    "Plan",
    "Prediction",
    "Problem",
    "Region",
    "Schedule",
    "ScheduleCost",
    "Solution",
    "SolverDecision",
    "Stage",
    "TensorDecision",
    "chain_from_trace",
    "coarsen",
    "dag_from_trace",
    "plan",
    "plan_trace",
    "predict",
    "schedule_cost",
    "solve",
    "solvers",
    "stage_key",
    "trace_step",
]
