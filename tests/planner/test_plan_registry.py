"""The solver registry (``remat.planner.solvers.registry``): it lists the solvers, and refuses
unknown names, problem shapes a solver does not take, unknown options and plans over the budget."""

from __future__ import annotations

import pytest

from remat import RematTypeError, RematValueError
from remat.planner import BackwardStep, Chain, Dag, Node, solvers


def test_the_registry_lists_the_solvers_and_refuses_unknown_names() -> None:
    assert {"auto", "chain", "greedy", "milp", "sqrt"} <= set(solvers.names())
    assert solvers.get("chain").problems == (Chain,)
    with pytest.raises(
        RematValueError, match=r"remat.plan: unknown solver \(got 'rotor'\); use one of auto, chain"
    ):
        solvers.get("rotor")


def test_the_registry_checks_problem_type_options_and_budget() -> None:
    chain = Chain.of([1], [1], [1], [1])
    dag = Dag((Node("a", 1, 1),), (BackwardStep("g", (0,)),))
    with pytest.raises(
        RematTypeError, match=r"solver 'chain' takes a Chain \(got Dag\); use auto, greedy, milp, sqrt"
    ):
        solvers.get("chain").solve(dag, 10)
    with pytest.raises(RematTypeError, match=r"unknown option for solver 'chain' \(got slot\); use slots"):
        solvers.get("chain").solve(chain, 10, slot=3)
    with pytest.raises(RematTypeError, match="a byte count is required"):
        solvers.get("chain").solve(chain, 0.5)  # type: ignore[arg-type]
    assert solvers.get("chain").solve(chain, "1KB").budget_bytes == 1000
