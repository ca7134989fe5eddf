"""Plans over modules that keep state beside autograd: a weight computed by a forward pre-hook and
kept as a module attribute (``torch.nn.utils.spectral_norm``, ``weight_norm``: NOTE [held past the
step] in ``remat.trace.types``), buffers written in place with ``out=`` (spectral norm's
power iteration: NOTE [written from outside] in ``remat.planner.region_model``) and running
statistics written through a view (instance norm). Every plan measures its prediction to the byte,
at or under its budget."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from plans import fixed_costs, step_peak
from torch import nn

from remat.planner import BudgetTooSmall, plan_trace, trace_step


def _conv() -> nn.Conv2d:
    return nn.Conv2d(8, 8, 3, padding=1)


BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "spectral_norm": lambda: nn.utils.spectral_norm(_conv()),
    "weight_norm": lambda: nn.utils.weight_norm(_conv()),
    "parametrized spectral_norm": lambda: nn.utils.parametrizations.spectral_norm(_conv()),
    "instance norm": lambda: nn.Sequential(_conv(), nn.InstanceNorm2d(8, track_running_stats=True)),
}


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_plans_measure_their_prediction(kind: str) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm's: use the parametrization
        model = nn.Sequential(*[nn.Sequential(BLOCKS[kind](), nn.ReLU()) for _ in range(6)])
    x = torch.randn(2, 8, 16, 16)

    def loss(m: nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    plain = step_peak(model, loss)
    trace = fixed_costs(trace_step(model, (), loss, repeats=1))
    with pytest.raises(BudgetTooSmall) as info:
        plan_trace(trace, 1000)
    floor = info.value.minimum_bytes
    for solver in ("sqrt", "chain", "auto"):
        for budget in (floor, floor + (plain - floor) // 4, floor + (plain - floor) // 2):
            plan = plan_trace(trace, budget, solver=solver)
            assert step_peak(model, loss, plan) == plan.predicted_peak_bytes <= budget, (solver, budget)
