"""The planner's lower-level public functions refuse what they cannot use with the planner's error
(they raised ``AttributeError`` or ``TypeError`` from deep inside, and a negative op cost gave a
plan predicted cheaper than no recomputation)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat.planner as planner
from remat import RematTypeError, RematValueError


@pytest.fixture(scope="module")
def trace() -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    return planner.trace_step(model, (torch.randn(8, 16),), lambda m, x: m(x).sum(), repeats=1)


CASES: dict[str, tuple[Callable[[Any], object], type[Exception], str]] = {
    "chain of None": (
        lambda t: planner.chain_from_trace(None),
        RematTypeError,
        r"chain_from_trace: trace must be Trace \(got NoneType\)",
    ),
    "chain depth 1.5": (
        lambda t: planner.chain_from_trace(t, depth=1.5),
        RematValueError,
        r"chain_from_trace: depth is a whole number of at least 0 or None \(got 1\.5\)",
    ),
    "chain key a string": (
        lambda t: planner.chain_from_trace(t, key="x"),
        RematTypeError,
        r"chain_from_trace: key must be NoneType \(got str\)",
    ),
    "dag max_nodes a string": (
        lambda t: planner.dag_from_trace(t, max_nodes="x"),
        RematValueError,
        r"dag_from_trace: max_nodes is a whole number of at least 1 or None \(got 'x'\)",
    ),
    "coarsen None": (
        lambda t: planner.coarsen(None, 5),
        RematTypeError,
        r"coarsen: dag must be Dag \(got NoneType\)",
    ),
    "coarsen 0 nodes": (
        lambda t: planner.coarsen(planner.dag_from_trace(t), 0),
        RematValueError,
        r"coarsen: max_nodes is a whole number of at least 1 \(got 0\)",
    ),
    "predict of None": (
        lambda t: planner.predict(None, []),
        RematTypeError,
        r"predict: trace must be Trace \(got NoneType\)",
    ),
    "predict a string": (
        lambda t: planner.predict(t, "x"),
        RematTypeError,
        r"predict: regions must be list or tuple \(got str\)",
    ),
    "predict a pair": (
        lambda t: planner.predict(t, [(3, 5)]),
        RematTypeError,
        r"predict: each region must be RegionOps \(got tuple\)",
    ),
    "stage_key depth": (
        lambda t: planner.stage_key("a.b", "x"),
        RematValueError,
        r"stage_key: depth is a whole number",
    ),
    "stage_key None": (
        lambda t: planner.stage_key(None),
        RematTypeError,
        r"stage_key: module must be str \(got NoneType\)",
    ),
    "trace_step of None": (
        lambda t: planner.trace_step(None, (torch.randn(2),)),
        RematTypeError,
        r"model must be an nn\.Module \(got NoneType\)",
    ),
    "stage cost a string": (
        lambda t: planner.Chain((planner.Stage("a", "x", 1.0, 100, 100),)),
        RematValueError,
        r"costs must be finite and non-negative \(stage 0: x\)",
    ),
    "stage cost negative": (
        lambda t: planner.Chain((planner.Stage("a", -1.0, 1.0, 100, 100),)),
        RematValueError,
        r"costs must be finite and non-negative \(stage 0: -1\.0\)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wrong_argument_is_a_clear_error(trace: Any, case: str) -> None:
    call, kind, match = CASES[case]
    planned = "trace_step" in case or "stage" in case  # ``remat.plan``'s own words
    with pytest.raises(kind, match=match if planned else r"remat\.planner\." + match):
        call(trace)
