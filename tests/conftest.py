"""Shared test fixtures: a ``device`` parameter with CPU always present and CUDA when available.

Property tests draw the same examples on every run (Hypothesis' ``derandomize``), so that a test
run's outcome never depends on chance; ``HYPOTHESIS_PROFILE=explore`` draws new ones, to search
for counterexamples on purpose.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _executor_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans leave the executor's own per-op time out (``ExecutorCost()``) unless a test passes
    figures: the ones calibrated by default depend on how busy the machine is, and which plan a
    test gets must not (NOTE [executor cost] in ``remat.planner.cost_model``)."""
    import remat.planner.frontier
    from remat.planner.cost_model import ExecutorCost

    monkeypatch.setattr(remat.planner.frontier, "measured", lambda device="cpu": ExecutorCost())
