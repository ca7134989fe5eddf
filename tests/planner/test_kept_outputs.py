"""A region that keeps an op with several outputs, one of which a later op of the region writes in
place (NOTE [kept beside a written output] in ``remat.planner.region_model``)."""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.planner import trace_step
from remat.planner.execute import apply
from remat.planner.region_model import RegionOps
from remat.planner.regions import Region
from remat.planner.search import Step, predicted


class _Block(nn.Module):
    """Convolution, batch norm, in-place ReLU (torchvision's ResNet), convolution."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.relu(self.bn(self.conv1(x))))


def test_keeping_batch_norm_before_an_in_place_relu_replays_it_as_predicted() -> None:
    """Kept, batch norm's statistics stay, but its result is written by the ReLU, so the tape
    replays batch norm for it all the same: the prediction replays it too, and so predicts what
    keeping nothing does, as the allocator measures (it once skipped any op with a kept output: 1
    MiB under the measured peak of a ResNet-50 plan, which measured above its budget)."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(16), _Block(16)).train()
    x = torch.randn(8, 16, 32, 32)
    trace = trace_step(model, (x,), lambda m, inp: m(inp).square().mean(), repeats=1)
    step = Step(trace)
    ops = [op.index for op in step.forward if op.module.startswith("1.")]
    bn = next(i for i in ops if trace.ops[i].name == "aten.native_batch_norm.default")
    keeping, nothing = step.region("1", ops, [bn]), step.region("1", ops)
    assert keeping is not None and nothing is not None
    kept, plain = predicted(step, [keeping]), predicted(step, [nothing])
    assert kept.work.replayed == plain.work.replayed  # batch norm runs again either way
    assert kept.peak_bytes == plain.peak_bytes  # keeping the statistics (128 bytes) moves no peak

    def measured(region: tuple[Region, RegionOps]) -> int:
        model.zero_grad(set_to_none=True)
        names, modules = [op.name for op in step.forward], [op.module for op in step.forward]
        with remat.memory.track(timeline=False, allocator=True) as tracked:
            with apply([region[0]], names, modules, model):
                loss = model(x).square().mean()  # the traced step: nothing else holds the output
            loss.backward()
        return tracked.peak_bytes

    assert measured(keeping) == kept.peak_bytes
    assert measured(nothing) == plain.peak_bytes
