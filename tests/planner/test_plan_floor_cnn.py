"""The planner never worse than per-block checkpointing on the CNN families (as
``test_plan_floor.py`` on the transformers): on the zoo's ResNet-50 and U-Net, with
``torch.utils.checkpoint`` around every bottleneck or double convolution, the smallest peak a plan
reaches is at or below what checkpointing measures, the plan at that floor measures its prediction
within it, and at checkpointing's peak the plan adds fewer convolution FLOPs than checkpointing."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from plans import fixed_costs, floor_of, step_peak
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat import zoo
from remat._flops import counted_flops
from remat.planner import plan_trace, trace_step
from remat.planner.api import block_key

BLOCKS = {"resnet50": "Bottleneck", "unet": "DoubleConv"}


@contextlib.contextmanager
def _per_block(model: nn.Module, kind: str) -> Iterator[None]:
    """``torch.utils.checkpoint`` (non-reentrant) around every block of type ``kind``."""
    wrapped = [m for m in model.modules() if type(m).__name__ == kind]
    for m in wrapped:
        m.forward = functools.partial(checkpoint, m.forward, use_reentrant=False)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m in wrapped:
            del m.forward


@functools.cache
def _family(name: str) -> tuple[nn.Module, Callable[[nn.Module], Any], Any, int, int]:
    """The model, its loss, its step traced on fixed costs, checkpointing's peak, the plans' floor."""
    torch.manual_seed(0)
    wl = zoo.build(name, tiny=True, batch=2, image=64)
    model = wl.model.train()

    def loss(m: nn.Module) -> torch.Tensor:
        return wl.loss_fn(m(*wl.inputs))

    step_peak(model, loss)  # a warm-up step
    with _per_block(model, BLOCKS[name]):
        checkpointed = step_peak(model, loss)
    trace = fixed_costs(trace_step(model, (), loss, repeats=1))
    return model, loss, trace, checkpointed, floor_of(trace, block_key=block_key(model))


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_the_smallest_plan_is_no_higher_than_per_block_checkpointing(name: str) -> None:
    model, loss, trace, checkpointed, floor = _family(name)
    assert floor <= checkpointed
    plan = plan_trace(trace, floor, block_key=block_key(model))
    assert step_peak(model, loss, plan) == plan.predicted_peak_bytes <= floor


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_at_checkpointings_peak_the_plan_recomputes_less_convolution(name: str) -> None:
    model, loss, trace, checkpointed, _ = _family(name)
    plan = plan_trace(trace, checkpointed, block_key=block_key(model))

    def step(region: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            with region():
                value = loss(model)
            value.backward()

        return run

    plain = counted_flops(step(contextlib.nullcontext))
    per_block = counted_flops(step(lambda: _per_block(model, BLOCKS[name]))) - plain
    planned = counted_flops(step(lambda: plan.apply(model))) - plain
    assert step_peak(model, loss, plan) <= checkpointed
    assert 0 <= planned < per_block
