"""Static planning: from one traced training step and a byte budget to the cheapest recomputation plan.

A captured step (``remat.trace``) becomes a problem, a ``Chain`` of blocks (``chain_from_trace``) or
a ``Graph`` of ops (``graph_from_trace``); a solver from ``remat.planner.solvers`` turns it into a
``Solution``: per stage or saved node, SAVE or RECOMPUTE, with the schedule and the predicted peak
and overhead under one simulated model. ``plan`` (``remat.plan``) wraps it all for a live model:
capture, solve, check the plan on the captured step (``predict``) and return a ``Plan`` that
``Plan.apply`` runs (``remat.planner.execute``).
"""

from remat.planner import solvers
from remat.planner.api import BudgetTooSmall, plan, plan_trace, trace_step
from remat.planner.plan import Plan, Region, TensorDecision
from remat.planner.predict import Prediction, predict
from remat.planner.problem import (
    Action,
    BackwardStep,
    Chain,
    ChainOp,
    ChainSchedule,
    ChainStep,
    Decision,
    Graph,
    GraphSchedule,
    GraphStage,
    Node,
    Problem,
    Schedule,
    Solution,
    Stage,
    chain_from_trace,
    coarsen,
    graph_from_trace,
    stage_key,
)
from remat.planner.solvers import solve

__all__ = [
    "Action",
    "BackwardStep",
    "BudgetTooSmall",
    "Chain",
    "ChainOp",
    "ChainSchedule",
    "ChainStep",
    "Decision",
    "Graph",
    "GraphSchedule",
    "GraphStage",
    "Node",
    "Plan",
    "Prediction",
    "Problem",
    "Region",
    "Schedule",
    "Solution",
    "Stage",
    "TensorDecision",
    "chain_from_trace",
    "coarsen",
    "graph_from_trace",
    "plan",
    "plan_trace",
    "predict",
    "solve",
    "solvers",
    "stage_key",
    "trace_step",
]
