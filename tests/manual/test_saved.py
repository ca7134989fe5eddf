"""Saved tensors written in place after they were saved: remat refuses them where autograd does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import remat

Run = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]
RUNS: dict[str, Run] = {"plain": lambda f, x: f(x), "remat": remat.checkpoint}


@pytest.mark.parametrize("how", sorted(RUNS))
def test_saved_output_written_after_the_forward(how: str) -> None:
    x = torch.randn(3, requires_grad=True)
    out = RUNS[how](torch.exp, x)  # exp saves its output
    out.add_(1)
    match = r"remat\.checkpoint: a tensor saved for backward .* modified in place .* \(\(3,\) float32"
    with pytest.raises(RuntimeError, match=match if how == "remat" else "modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("how", sorted(RUNS))
def test_saved_input_written_after_the_forward(how: str) -> None:
    x = torch.randn(3, requires_grad=True)
    h = x * 2
    out = RUNS[how](torch.sin, h)  # sin saves its input
    h.add_(1)
    match = r"remat\.checkpoint: a tensor saved for backward .*at version 1, saved at 0"
    with pytest.raises(RuntimeError, match=match if how == "remat" else "modified by an inplace operation"):
        out.sum().backward()


def test_value_check_names_the_op_of_a_written_tensor() -> None:
    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint(torch.exp, x, debug=True)
    out.mul_(2)
    with pytest.raises(
        remat.RematRuntimeError, match=r"\(op aten\.exp\.default in module .*\) was modified in place"
    ):
        out.sum().backward()


def test_writes_before_saving_are_fine() -> None:
    x = torch.randn(3, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = t * 2
        h.add_(1)  # written before exp saves its output
        return h.exp()

    expected = torch.autograd.grad(fn(x).sum(), x)
    got = torch.autograd.grad(remat.checkpoint(fn, x).sum(), x)
    assert torch.equal(expected[0], got[0])


def test_saved_tensors_of_a_custom_function_as_torch_hands_them_back() -> None:
    seen: list[tuple[bool, bool]] = []

    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            ctx.inputs = (a, b)
            return a * b

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ctx.saved_tensors
            seen.append((a is ctx.inputs[0], b is ctx.inputs[1]))
            return g * b, g * a

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return Mul.apply(a, b).sin()

    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    grads = []
    for run in (
        lambda: torch.utils.checkpoint.checkpoint(fn, x, y, use_reentrant=False),
        lambda: remat.checkpoint(fn, x, y, use_reentrant=False),
    ):
        grads.append(torch.autograd.grad(run().sum(), (x, y)))
    assert seen[0] == seen[1]  # saved-tensor hooks hand back new objects, in torch as in remat
    for e, g in zip(*grads, strict=True):
        assert torch.equal(e, g)
