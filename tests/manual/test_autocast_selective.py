"""Saving policies under autocast: autocast caches the cast of a leaf that requires grad, so the
recomputation (whose inputs are such leaves) casts fewer times than the forward; the saved outputs
must still be handed back to the ops that made them (casts take no position)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import remat

POLICIES: dict[str, dict[str, Any]] = {
    "SaveComputeIntensive": {"policy": remat.SaveComputeIntensive()},
    "context_fn": {
        "context_fn": functools.partial(
            create_selective_checkpoint_contexts, [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
        )
    },
}


def _three_projections(weights: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The input cast once per matmul in the forward (post-LN attention's q, k and v)."""
    a, b, c = weights

    def f(x: torch.Tensor) -> torch.Tensor:
        return ((x @ c).exp() + (x @ a) * (x @ b)).float()  # exp saves its output, made from c's

    return f


def _grads(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor]) -> list:
    h = x * 1.0  # a non-leaf input, as a layer's hidden states are
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(h)
    return list(torch.autograd.grad(out.sum(), [x, *weights]))


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_a_saving_policy_under_autocast_gives_the_plain_gradients(
    kind: str, weight_dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    weights = [torch.randn(8, 8, dtype=weight_dtype, requires_grad=True) for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)
    f = _three_projections(weights)
    expected = _grads(f, x, weights)
    got = _grads(lambda h: remat.checkpoint(f, h, **POLICIES[kind]), x, weights)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_without_autocast_a_policy_may_keep_a_cast() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    ran: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ran.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(8, 8, requires_grad=True)
    out = remat.checkpoint(lambda t: t.double().exp(), x, policy=remat.SaveOps(frozenset({"aten._to_copy"})))
    with Count():
        out.sum().backward()
    assert "aten.exp.default" in ran and "aten._to_copy.default" in ran  # recomputed exp; the grad's cast
    assert ran.count("aten._to_copy.default") == 1  # the forward's cast was kept, not run again
