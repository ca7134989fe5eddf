"""The plan executor's own cost per op, measured: a short calibration on tiny tensors per device.

Why measure it rather than take it from the trace: the capture times each op's kernel (the call
below autograd), while a plan runs every forward op of the model through the executor's dispatch
mode, records a region's ops on a tape and replays them from Python in backward (NOTE [executor
cost] in ``remat.planner.cost_model``). None of that is an op of the step, so no trace sees it. On
tiny tensors the kernels cost next to nothing, so the difference between a step run plainly and the
same step run under the executor is the executor's own time. The calibration's model is a stack of
tiny blocks of the ops models are made of (a convolution, batch norm, ReLU, a residual add, a linear
layer, layer norm, GELU, views), since the cost of an op under the executor grows with its tensor
arguments and outputs. Its step runs four ways, interleaved over rounds: plainly; under
``plan.apply`` with no region (the check alone); with one region over every op (the tape, and its
replay in backward); with every saved output offloaded (the hooks and the offloader, on a link of
the default rates: its copies are a few hundred bytes); and a forward without autograd (the
kernels). Each difference is taken within a round, and the figure is its median over the rounds:
the machine's speed drifts between rounds, and a difference of medians taken over different rounds
could come out negative. Per op: the forward's difference ÷ the ops checked or recorded; the
backward's difference, less the replayed ops' kernels (the forward without autograd, per op), ÷
the ops replayed; the offloaded run's difference ÷ the tensors moved. The counts come from
``predict`` on the model's own trace, so that the figures divide exactly the work the prediction
multiplies them by.

Times are the process's CPU time (``time.process_time``) with one intra-op thread: the executor's
work is the host's, single-threaded, and on a machine doing other work too the wall clock counts
the waits for a core, which have nothing to do with the executor (the capture times ops on the
wall clock: on a busy machine its op times, and so the plain step the figures are weighed
against, come out long, and the executor's share short). On CUDA the kernels are launched, not
waited for: what is measured is the host's time, the part that adds to a step that is host-bound.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from remat._errors import RematValueError, message
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

_BLOCKS = 4  # tiny blocks in the calibration's model
_ROUNDS = 15
_WARMUP = 2
_CHANNELS = 4
_SIDE = 4


class _Block(nn.Module):
    """A residual convolution and a linear layer with layer norm and GELU, on a few numbers."""

    def __init__(self) -> None:
        super().__init__()
        width = _CHANNELS * _SIDE * _SIDE
        self.conv = nn.Conv2d(_CHANNELS, _CHANNELS, 3, padding=1)
        self.norm = nn.BatchNorm2d(_CHANNELS)
        self.linear = nn.Linear(width, width)
        self.ln = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x))) + x
        flat = nn.functional.gelu(self.ln(self.linear(h.flatten(1))))
        return flat.view_as(x) * h


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_Block() for _ in range(_BLOCKS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).sum()


_KERNELS = "kernels"


def _rounds(
    model: nn.Module,
    x: torch.Tensor,
    contexts: dict[str, Callable[[], contextlib.AbstractContextManager[None]]],
) -> list[dict[str, tuple[float, float]]]:
    """Per round: each way of running's forward and backward seconds, the ways interleaved (every
    other round in reverse order), and under ``_KERNELS`` the forward without autograd (its
    kernels, as a replay runs them) and no backward."""
    rounds: list[dict[str, tuple[float, float]]] = []
    for k in range(_WARMUP + _ROUNDS):
        times: dict[str, tuple[float, float]] = {}
        for name in list(contexts) if k % 2 == 0 else reversed(list(contexts)):
            model.zero_grad(set_to_none=True)
            with contexts[name]():
                start = time.process_time()
                loss = model(x)
                middle = time.process_time()
                loss.backward()
                end = time.process_time()
            times[name] = (middle - start, end - middle)
        with torch.no_grad():
            start = time.process_time()
            model(x)
            times[_KERNELS] = (time.process_time() - start, 0.0)
        if k >= _WARMUP:
            rounds.append(times)
    return rounds


def calibrate(device: torch.device | str = "cpu") -> ExecutorCost:
    """Measure the executor's per-op figures on ``device`` (see the module doc); about a second on
    a CPU. The model's parameters and batch-norm statistics are its own, the global RNG is not
    drawn from, and the caller's autocast does not apply (its cast cache would hand the capture's
    casts to the runs measured after it, which would then not run the ops the capture traced)."""
    dev = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.random.set_rng_state(generator.get_state())
        model = _Stack().to(dev)
        x = torch.randn(2, _CHANNELS, _SIDE, _SIDE, generator=generator).to(dev)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.autocast(dev.type, enabled=False):
            return _calibrate(model, x)
    finally:
        torch.set_num_threads(threads)


def _calibrate(model: nn.Module, x: torch.Tensor) -> ExecutorCost:
    trace = capture(lambda: model(x).backward(), name="calibration", scratch=False)
    model.zero_grad(set_to_none=True)
    forward = [op for op in trace.ops if op.phase is Phase.FORWARD and op.module and op.name not in UNCOUNTED]
    ops, modules = [op.name for op in forward], [op.module for op in forward]
    whole = Region("calibration", 0, len(forward) - 1)
    made = {trace.root(t) for op in forward for t in op.outputs}
    moved = len(made & trace.saved_roots)
    work = predict(trace, [RegionOps(tuple(op.index for op in forward))]).work
    rounds = _rounds(
        model,
        x,
        {
            "plain": contextlib.nullcontext,
            "check": lambda: apply((), ops, modules, model, check="every"),
            "tape": lambda: apply((whole,), ops, modules, model),
            "offload": lambda: apply_offload(
                (), ops, modules, model, "eager", frozenset(range(len(ops))), Link()
            ),
        },
    )

    def median(figure: Callable[[dict[str, tuple[float, float]]], float]) -> float:
        """The median over rounds of a difference taken within each round (so that the machine's
        drift from round to round cancels), and not below 0."""
        return max(statistics.median(figure(r) for r in rounds), 0.0)

    share = work.replayed / work.checked  # of the forward's kernels, what a replay runs again
    return ExecutorCost(
        check=median(lambda r: r["check"][0] - r["plain"][0]) / work.checked,
        record=median(lambda r: r["tape"][0] - r["check"][0]) / work.recorded,
        replay=median(lambda r: r["tape"][1] - r["check"][1] - r[_KERNELS][0] * share)
        / max(work.replayed, 1),
        offload=median(lambda r: sum(r["offload"]) - sum(r["check"])) / max(moved, 1),
    )


@functools.cache
def _measured(device: str) -> ExecutorCost:
    return calibrate(device)


def measured(device: torch.device | str = "cpu") -> ExecutorCost:
    """The executor's per-op figures on ``device``'s kind, calibrated the first time a process asks
    (``calibrate``) and the same figures after. A kind this machine lacks (a trace captured on a
    GPU, planned on a CPU) is refused: the figures are measured, not assumed."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    module = getattr(torch, kind, None) if kind not in (None, "cpu") else None
    if kind is None or (kind != "cpu" and not (module is not None and module.is_available())):
        rule = "the executor's per-op cost is measured on the step's device, which this machine lacks"
        hint = "pass executor_cost=remat.planner.ExecutorCost(...) with that device's figures"
        raise RematValueError(
            message("plan", rule, f"got {str(device)!r}", hint + " (ExecutorCost() for none)")
        )
    return _measured(kind)
