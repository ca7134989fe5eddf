"""The plan executor's own cost per op, measured: a short calibration on tiny tensors per device.

Why measure it rather than take it from the trace: the capture times each op's kernel (the call
below autograd), while a plan runs every forward op of the model through the executor's dispatch
mode, records a region's ops on a tape and replays them from Python in backward (NOTE [executor
cost] in ``remat.planner.cost_model``). None of that is an op of the step, so no trace sees it. On
tiny tensors the kernels cost next to nothing, so the difference between a step run plainly and the
same step run under the executor is the executor's own time: the calibration runs a chain of
pointwise ops (one parameter, ``_OPS`` sines on eight numbers, a sum) four ways, interleaved over
rounds: plainly; under ``plan.apply`` with no region (the check alone); with one region over every
op (the tape, and its replay in backward); with every saved output offloaded (the hooks and the
offloader, on a link of the default rates: its copies are eight numbers). Per op: the median
forward's difference ÷ the ops checked or recorded, the median backward's ÷ the ops replayed less
one op's own time (an op called as the replay calls it, which is what the trace times), the
offloaded run's difference ÷ the tensors moved. The counts come from ``predict`` on the chain's
trace, so that the figures divide exactly the work the prediction multiplies them by.

Times are the process's CPU time (``time.process_time``): the figures are host time, which is what
the executor spends, and a shared machine's other work does not inflate them. On CUDA the kernels
are launched, not waited for: what is measured is the host's time, the part that adds to a step
that is host-bound.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from remat.host.link import Link
from remat.planner.cost_model import ExecutorCost
from remat.planner.execute import UNCOUNTED, apply
from remat.planner.offload_execute import apply_offload
from remat.planner.predict import predict
from remat.planner.region_model import RegionOps
from remat.planner.regions import Region
from remat.trace import capture
from remat.trace.types import Phase

__all__ = ["calibrate", "measured"]

_OPS = 48  # sines in the calibration's chain
_ROUNDS = 15
_WARMUP = 2


class _Body(nn.Module):
    def __init__(self, ops: int) -> None:
        super().__init__()
        self.ops = ops
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale
        for _ in range(self.ops):
            h = torch.sin(h)
        return h.sum()


class _Chain(nn.Module):
    """The calibration's model: every op inside a submodule, as the executor counts them."""

    def __init__(self, ops: int) -> None:
        super().__init__()
        self.body = _Body(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _median_step(
    model: nn.Module,
    x: torch.Tensor,
    contexts: dict[str, Callable[[], contextlib.AbstractContextManager[None]]],
) -> dict[str, tuple[float, float]]:
    """Per way of running: the median forward and backward CPU seconds over interleaved rounds."""
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in contexts}
    for k in range(_WARMUP + _ROUNDS):
        for name, context in contexts.items():
            model.zero_grad(set_to_none=True)
            with context():
                start = time.process_time()
                loss = model(x)
                middle = time.process_time()
                loss.backward()
                end = time.process_time()
            if k >= _WARMUP:
                times[name][0].append(middle - start)
                times[name][1].append(end - middle)
    return {name: (statistics.median(f), statistics.median(b)) for name, (f, b) in times.items()}


def _op_time(x: torch.Tensor) -> float:
    """One sine's CPU seconds called as a replay calls it (the overload, no autograd)."""
    sin = torch.ops.aten.sin.default
    runs = []
    with torch.no_grad():
        for _ in range(_ROUNDS):
            start = time.process_time()
            for _ in range(_OPS):
                sin(x)
            runs.append((time.process_time() - start) / _OPS)
    return statistics.median(runs)


def calibrate(device: torch.device | str = "cpu") -> ExecutorCost:
    """Measure the executor's per-op figures on ``device`` (see the module doc); a fraction of a
    second on a CPU."""
    dev = torch.device(device)
    model = _Chain(_OPS).to(dev)
    x = torch.randn(8, device=dev)
    trace = capture(lambda: model(x).backward(), name="calibration", repeats=1, scratch=False)
    model.zero_grad(set_to_none=True)
    forward = [op for op in trace.ops if op.phase is Phase.FORWARD and op.module and op.name not in UNCOUNTED]
    ops, modules = [op.name for op in forward], [op.module for op in forward]
    whole = Region("calibration", 0, len(forward) - 1)
    made = {trace.root(t) for op in forward for t in op.outputs}
    moved = len(made & {trace.root(t) for t in trace.saved})
    work = predict(trace, [RegionOps(tuple(op.index for op in forward))]).work
    figures = _median_step(
        model,
        x,
        {
            "plain": contextlib.nullcontext,
            "check": lambda: apply((), ops, modules, model),
            "tape": lambda: apply((whole,), ops, modules, model),
            "offload": lambda: apply_offload(
                (), ops, modules, model, "eager", frozenset(range(len(ops))), Link()
            ),
        },
    )
    kernel = _op_time(x)
    plain, check, tape, offload = (figures[k] for k in ("plain", "check", "tape", "offload"))
    return ExecutorCost(
        check=max(check[0] - plain[0], 0.0) / work.checked,
        record=max(tape[0] - check[0], 0.0) / work.recorded,
        replay=max((tape[1] - check[1]) / max(work.replayed, 1) - kernel, 0.0),
        offload=max(sum(offload) - sum(check), 0.0) / max(moved, 1),
    )


@functools.cache
def _measured(device: str) -> ExecutorCost:
    return calibrate(device)


def measured(device: torch.device | str = "cpu") -> ExecutorCost:
    """The executor's per-op figures on ``device``'s kind, calibrated the first time a process asks
    (``calibrate``) and the same figures after."""
    return _measured(torch.device(device).type)
