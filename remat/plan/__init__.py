"""Static planning: from one traced training step and a byte budget to the cheapest recomputation plan.

A captured step (``remat.trace``) becomes a problem, a ``Chain`` of blocks (``chain_from_trace``) or
a ``Graph`` of ops (``graph_from_trace``); a solver from ``remat.plan.solvers`` turns it into a
``Solution``: per stage or saved node, SAVE or RECOMPUTE, with the schedule and the predicted peak
and overhead under one simulated model. Executing a Solution on a live model is a separate layer.
"""

from remat.plan import solvers
from remat.plan.problem import (
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
from remat.plan.solvers import solve

__all__ = [
    "Action",
    "BackwardStep",
    "Chain",
    "ChainOp",
    "ChainSchedule",
    "ChainStep",
    "Decision",
    "Graph",
    "GraphSchedule",
    "GraphStage",
    "Node",
    "Problem",
    "Schedule",
    "Solution",
    "Stage",
    "chain_from_trace",
    "coarsen",
    "graph_from_trace",
    "solve",
    "solvers",
    "stage_key",
]
