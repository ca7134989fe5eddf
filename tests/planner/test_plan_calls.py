"""A plan's region that is exactly one module's call runs as the module's re-run, with no tape
(NOTE [one call], ``remat.planner.rerun``); any other region records a tape. Either way the step
computes exactly what the plain model does (losses, gradients, buffers, the RNG stream after it)
and the allocator measures at most the prediction."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from models import assert_same, build, loss_of, train, twin
from plans import SCALARS, fixed_costs
from torch import nn

import remat
from remat import Plan, RematRuntimeError
from remat.planner import plan_trace, trace_step
from remat.planner.api import block_key
from remat.planner.execute import _Runner
from remat.planner.predict import predict
from remat.planner.regions import Region, one_call
from remat.planner.rerun import CallFrame
from remat.planner.search import Step


def test_one_call_is_the_deepest_module_whose_call_is_exactly_the_run() -> None:
    modules = ["stem", "layers.0.conv", "layers.0.bn", "layers.0", "layers.1.conv", "layers.1", "head"]
    assert one_call(modules, 1, 3) == "layers.0"
    assert one_call(modules, 1, 2) == ""  # a part of layers.0's call
    assert one_call(modules, 1, 5) == ""  # two calls: "layers" is a container, not called
    assert one_call(modules, 4, 5) == "layers.1"
    assert one_call(modules, 4, 4) == "layers.1.conv"  # the conv's own call, inside layers.1's
    assert one_call(modules, 0, 0) == "stem"
    assert one_call(modules, 0, 6) == ""  # the model's own call is not a region's


@functools.cache
def _step(name: str) -> tuple[Step, Plan]:
    model, batch, _ = build(name)
    trace = fixed_costs(trace_step(model, batch(0), repeats=1))
    return Step(trace, block_key(model)), plan_trace(trace, 1.0, block_key=block_key(model))


def _plan(name: str, spans: list[tuple[str, str]], keep: int = -1) -> tuple[Plan, int]:
    """A plan of one region per span of blocks (first and last block's key), keeping the output
    of the op ``keep`` places into the region (none when negative); and its predicted peak."""
    step, base = _step(name)
    runs = {step.key(step.trace.ops[run[0]].module): run for run in step.blocks()}
    made = []
    for first, last in spans:
        ops = [i for i in range(runs[first][0], runs[last][-1] + 1)]
        made.append(step.region(f"{first}..{last}", ops, [ops[keep]] if keep >= 0 else []))
    regions = [m for m in made if m is not None]
    peak = predict(step.trace, [ops for _, ops in regions]).peak_bytes
    return dataclasses.replace(base, regions=tuple(r for r, _ in regions)), peak


class _Paths:
    """How many forwards ran module re-runs, and how many regions recorded tapes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = self.tapes = 0
        run, start = CallFrame.run, _Runner._start

        def counted_run(frame: CallFrame, *args: Any) -> Any:
            self.calls += 1
            return run(frame, *args)

        def counted_start(runner: _Runner, region: Region) -> None:
            self.tapes += 1
            start(runner, region)

        monkeypatch.setattr(CallFrame, "run", counted_run)
        monkeypatch.setattr(_Runner, "_start", counted_start)


def _measured(model: nn.Module, inputs: dict[str, Any], plan: Plan) -> int:
    model.zero_grad(set_to_none=True)
    with remat.memory.track(timeline=False, allocator=True) as tracked:
        with plan.apply(model):
            loss = loss_of(model(**inputs))
        loss.backward()
    return tracked.peak_bytes


def _check(name: str, plan: Plan, peak: int) -> None:
    model, batch, _ = build(name)
    planned = twin(model)
    ran = train(planned, batch, steps=2, region=lambda: plan.apply(planned))
    assert_same(train(model, batch, steps=2), ran)
    assert _measured(planned, batch(0), plan) <= peak + SCALARS


@pytest.mark.parametrize(
    ("name", "spans"),
    [
        ("cnn", [("layers.0", "layers.0"), ("layers.2", "layers.2")]),
        ("bert", [("bert.encoder.layer.0", "bert.encoder.layer.0")]),
    ],
)
def test_a_region_that_is_one_blocks_call_reruns_the_block(
    name: str, spans: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch norm (running statistics written once), Dropout2d and BERT's dropouts (the stream
    replayed from one state per call): bit for bit the plain step, within the predicted peak."""
    plan, peak = _plan(name, spans)
    paths = _Paths(monkeypatch)
    _check(name, plan, peak)
    assert paths.calls == 3 * len(spans)  # per region, per forward: 2 training steps, 1 measured
    assert paths.tapes == 0


def test_a_region_of_two_blocks_records_a_tape(monkeypatch: pytest.MonkeyPatch) -> None:
    plan, peak = _plan("cnn", [("layers.0", "layers.1")])
    paths = _Paths(monkeypatch)
    _check("cnn", plan, peak)
    assert (paths.calls, paths.tapes) == (0, 3)


def test_a_region_keeping_an_op_records_a_tape(monkeypatch: pytest.MonkeyPatch) -> None:
    plan, peak = _plan("cnn", [("layers.1", "layers.1")], keep=0)
    assert plan.regions[0].save
    paths = _Paths(monkeypatch)
    _check("cnn", plan, peak)
    assert (paths.calls, paths.tapes) == (0, 3)


class _Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 2).sin()


class _Writes(nn.Module):
    """Writes its block's input in place after the block's call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.block = _Twice()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = self.block(h)
        h.add_(1)
        return y.sum()


def test_an_argument_written_after_the_call_is_refused_in_backward() -> None:
    model = _Writes()
    x = torch.randn(3, 4)
    trace = fixed_costs(trace_step(model, {"x": x}, repeats=1))
    step = Step(trace)
    block = [op.index for op in step.forward if op.module.startswith("block")]
    made = step.region("block", block)
    assert made is not None
    plan = dataclasses.replace(plan_trace(trace, 1.0), regions=(made[0],))
    with plan.apply(model):
        loss = model(x)
    with pytest.raises(RematRuntimeError, match="modified in place after the call"):
        loss.backward()
