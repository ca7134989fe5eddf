"""What a plan keeps first when it fills the room under its peak (NOTE [room under the peak])."""

from __future__ import annotations

import torch
from plans import fixed_costs
from torch import nn

from remat.planner import trace_step
from remat.planner.room import _rankings, _spare
from remat.planner.search import Step


class _Chain(nn.Module):
    """Two saved storages of one size and one op's cost: a sigmoid of a parameter, which spares
    only itself when kept, and the ReLU of a projection, whose keeping spares the matrix product
    under it too (nothing else saves the product)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(64, 256))
        self.proj = nn.Linear(256, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.sigmoid(self.gate) * 3).sum() + (torch.relu(self.proj(x)) * 2).sum()


def test_a_region_ranks_first_what_spares_the_most_replay_per_byte() -> None:
    torch.manual_seed(0)
    trace = fixed_costs(trace_step(_Chain(), (torch.randn(64, 256),), repeats=1))
    step = Step(trace)
    made = step.region("all", [op.index for op in step.forward])
    assert made is not None
    ops = made[1]
    names = {i: trace.ops[i].name for i in ops.ops}
    spare = _spare(step, ops)
    assert sorted(names[i] for i in spare) == ["aten.relu.default", "aten.sigmoid.default"]
    relu, sigmoid = (
        next(i for i in spare if names[i] == n) for n in ("aten.relu.default", "aten.sigmoid.default")
    )
    assert trace.ops[relu].cost == trace.ops[sigmoid].cost  # the same own time per byte
    by_chain, by_op = _rankings(step, ops, spare)
    assert by_chain == [relu, sigmoid]  # keeping the ReLU spares the product too
    assert by_op == [sigmoid, relu]  # by own time, a tie: forward order
