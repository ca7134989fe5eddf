"""The planner's data and cost model: problems refuse bad shapes, the
cost model (``remat.planner.cost_model``) refuses impossible schedules, and the single-level
schedules (``remat.planner.single_level``) recompute just in time."""

from __future__ import annotations

import pytest

from remat import RematValueError
from remat.planner import BackwardStep, Chain, ChainSchedule, Dag, DagStage, Node, Stage
from remat.planner.cost_model import schedule_cost
from remat.planner.single_level import dag_from_saved


def test_the_cost_model_refuses_impossible_chain_schedules() -> None:
    chain = Chain.of([1, 1], [1, 1], [1, 1], [1, 1])
    with pytest.raises(RematValueError, match="B k runs in order"):
        schedule_cost(chain, ChainSchedule.parse("F_all 0-1, B 0"))
    with pytest.raises(RematValueError, match="needs its input alive"):
        schedule_cost(chain, ChainSchedule.parse("F_n 1"))
    with pytest.raises(RematValueError, match="runs every backward step"):
        schedule_cost(chain, ChainSchedule.parse("F_all 0-1, B 1"))


def test_dag_schedules_from_saved_sets_recompute_just_in_time() -> None:
    dag = Dag(
        (Node("a", 1, 4), Node("b", 2, 8, (0,)), Node("c", 3, 2, (1,))),
        (BackwardStep("gc", (2,), 1, 1), BackwardStep("gb", (1,), 1, 1), BackwardStep("ga", (0,), 1, 1)),
    )
    everything = schedule_cost(dag, dag_from_saved(dag, (0, 1, 2)))
    only_a = dag_from_saved(dag, (0,))
    cost = schedule_cost(dag, only_a)
    assert everything.runs == (1, 1, 1) and cost.runs == (1, 2, 2)
    assert cost.total_cost == everything.total_cost + 2 + 3
    assert only_a.stages[3:] == (DagStage((1, 2), (2,)), DagStage((), (1,)), DagStage((), (0,)))
    assert str(only_a).endswith("1 2 | drop 2; - | drop 1; - | drop 0")


def test_problems_refuse_bad_shapes() -> None:
    with pytest.raises(RematValueError, match="a chain needs at least one stage"):
        Chain(())
    with pytest.raises(RematValueError, match="byte counts must be non-negative"):
        Chain((Stage("s", 1, 1, -1, 0),))
    with pytest.raises(RematValueError, match="deps must be earlier nodes"):
        Dag((Node("a", 1, 1, (0,)),), ())
    with pytest.raises(RematValueError, match="a backward step reads forward nodes"):
        Dag((Node("a", 1, 1),), (BackwardStep("g", (3,)),))
