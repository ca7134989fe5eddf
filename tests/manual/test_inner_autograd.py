"""Autograd inside a checkpointed function (gradient penalty, MAML's inner step): plain gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat

POLICIES: dict[str, dict[str, Any]] = {
    "recompute-all": {},
    "save-compute-intensive": {"policy": remat.SaveComputeIntensive()},
    "value-check": {"debug": True},
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))


def _assert_same_grads(
    fn: Callable[..., torch.Tensor], wrapped: Callable[..., torch.Tensor], inputs: list[torch.Tensor]
) -> None:
    expected = torch.autograd.grad(fn(*inputs), inputs)
    got = torch.autograd.grad(wrapped(*inputs), inputs)
    assert len(got) == len(expected) > 0
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def _gradient_penalty(net: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor) -> torch.Tensor:
        y = net(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y.mean() + (g.norm(dim=1) - 1).pow(2).mean()

    return loss


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_gradient_penalty(kind: str) -> None:
    net = _net()
    loss = _gradient_penalty(net)
    x = torch.randn(5, 4, requires_grad=True)
    _assert_same_grads(
        lambda *i: loss(i[0]),
        lambda *i: remat.checkpoint(loss, i[0], **POLICIES[kind]),
        [x, *net.parameters()],
    )


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_maml_inner_step(kind: str) -> None:
    torch.manual_seed(1)
    x, target = torch.randn(6, 4), torch.randn(6, 1)
    w1, w2 = torch.randn(4, 8, requires_grad=True), torch.randn(8, 1, requires_grad=True)

    def adapted_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        def loss(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
            return ((x @ p).tanh() @ q - target).pow(2).mean()

        ga, gb = torch.autograd.grad(loss(a, b), (a, b), create_graph=True)
        return loss(a - 0.1 * ga, b - 0.1 * gb)

    _assert_same_grads(
        adapted_loss, lambda a, b: remat.checkpoint(adapted_loss, a, b, **POLICIES[kind]), [w1, w2]
    )


def test_nested_checkpoint_inside_a_gradient_penalty() -> None:
    net = _net()
    inner = remat.checkpoint(nn.Sequential(nn.Linear(1, 3), nn.Tanh()))

    def loss(x: torch.Tensor) -> torch.Tensor:
        return _gradient_penalty(net)(x) + inner(net(x)).sum()

    x = torch.randn(5, 4, requires_grad=True)
    params = [x, *net.parameters(), *inner.parameters()]
    expected = torch.autograd.grad(loss(x), params)
    got = torch.autograd.grad(remat.checkpoint(loss, x), params)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_a_derivative_with_respect_to_a_tensor_made_before_the_inputs_is_refused_with_remats_error() -> None:
    """A PINN-style derivative of the block's output with respect to the coordinates its input was
    computed from: run again on inputs cut from what made them (NOTE [inputs cut]), torch finds no
    path; remat says so, where torch's own error came out of the backward before."""
    torch.manual_seed(0)
    embed, head = nn.Linear(2, 8), nn.Linear(8, 1)
    coords = torch.randn(16, 2, requires_grad=True)

    def block(h: torch.Tensor) -> torch.Tensor:
        u = head(h)
        (du,) = torch.autograd.grad(u.sum(), coords, create_graph=True)
        return u * du.square().sum(1, keepdim=True)

    y = remat.checkpoint(block, torch.tanh(embed(coords)))
    with pytest.raises(
        remat.RecomputationError,
        match=r"remat\.checkpoint: the function raised when run again in backward, where its inputs are "
        r"detached from what made them .*\(RuntimeError: .*not have been used in the graph.*\); keep a "
        r"function that differentiates",
    ):
        y.square().sum().backward()


def test_a_backward_run_again_is_refused_where_it_would_add_to_grad_twice() -> None:
    """NOTE [backward run again]: ``.backward()`` inside a checkpointed function added to ``.grad``
    once in forward and once more when backward ran the function again (``v.grad`` doubled, no
    error, as ``torch.utils.checkpoint`` does); now the run again refuses it by name. Other threads
    and code after the refusal call torch's own ``backward``."""
    torch.manual_seed(0)
    w, v, x = torch.randn(8, 8, requires_grad=True), torch.randn(8, requires_grad=True), torch.randn(4, 8)

    def inner_step(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w)
        (h.sum() * v).sum().backward(retain_graph=True, inputs=[v])
        return h.sin()

    out = remat.checkpoint(inner_step, x).sum()
    assert v.grad is not None
    with pytest.raises(remat.RecomputationError, match=r"remat\.checkpoint: .* may not call \.backward\(\)"):
        out.backward()
    w.grad = v.grad = None
    torch.tanh(x @ w).sum().backward()  # torch's own again
    assert w.grad is not None and "remat" not in getattr(torch.autograd.backward, "__module__", "")


@pytest.mark.parametrize("form", ["checkpoint", "scope"])
def test_gradients_batched_through_dropout_equal_plain(form: str) -> None:
    """``torch.autograd.grad(..., is_grads_batched=True)`` runs backward under torch's vmap mode,
    which refuses random ops: the run again of a dropout (checkpoint) or its replay (scope) now runs
    outside it, as the forward ran, and the batched gradients are the plain ones bit for bit."""

    def run(wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.Tanh())
        x = torch.randn(2, 16, requires_grad=True)
        y = wrap(net, x)
        rows = torch.eye(16).reshape(16, 1, 16).expand(16, 2, 16)  # a Jacobian row per entry
        return torch.autograd.grad(y, x, rows, is_grads_batched=True)[0]

    def scoped(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with remat.scope():
            return net(x)

    wrap = remat.checkpoint if form == "checkpoint" else scoped
    assert torch.equal(run(wrap), run(lambda net, x: net(x)))
