"""Offload in every form computes exactly what the plain model computes: losses, every gradient,
buffers (batch norm's running statistics) and the RNG stream after training, bit for bit, on GPT-2,
BERT (``transformers`` configs, random weights) and a CNN with batch norm."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from models import assert_same, build, train, twin
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat

MODELS = ["gpt2", "bert", "cnn"]


def _in_scope(block: nn.Module, policy: remat.Policy, offloader: remat.Offloader) -> None:
    forward = block.forward

    @functools.wraps(forward)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with remat.scope(policy, offloader=offloader):
            return forward(*args, **kwargs)

    block.forward = scoped  # type: ignore[method-assign]


@pytest.mark.parametrize("name", MODELS)
def test_the_offload_region_matches_plain(name: str) -> None:
    model, batch, _ = build(name)
    offloaders: list[remat.Offloader] = []

    @contextmanager
    def region() -> Iterator[None]:
        with remat.offload(prefetch=2) as offloader:
            offloaders.append(offloader)
            yield

    wrapped = twin(model)
    assert_same(train(model, batch), train(wrapped, batch, region=region))
    assert all(o.stats().moved > 0 for o in offloaders)
    assert all(o.stats().bytes_back == o.stats().bytes_out for o in offloaders)


@pytest.mark.parametrize("name", MODELS)
def test_the_offload_region_with_a_policy_matches_plain(name: str) -> None:
    model, batch, _ = build(name)
    offloaders: list[remat.Offloader] = []

    @contextmanager
    def region() -> Iterator[None]:
        with remat.offload(remat.OffloadComputeIntensive(), min_bytes=256) as offloader:
            offloaders.append(offloader)
            yield

    wrapped = twin(model)
    assert_same(train(model, batch), train(wrapped, batch, region=region))
    assert all(o.stats().moved > 0 for o in offloaders)


POLICIES = [
    pytest.param(remat.OffloadComputeIntensive(), id="compute-intensive"),
    pytest.param(remat.OffloadLarger(1024), id="larger"),
    pytest.param(remat.OffloadOps(frozenset({"aten.addmm", "aten.convolution", "aten.gelu"})), id="ops"),
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", MODELS)
def test_checkpoint_with_offload_decisions_matches_plain(name: str, policy: remat.Policy) -> None:
    model, batch, blocks = build(name)
    wrapped = twin(model)
    offloader = remat.Offloader(prefetch=1)
    for block in blocks(wrapped):
        remat.checkpoint(block, policy=policy, offloader=offloader)
    assert_same(train(model, batch), train(wrapped, batch))
    assert offloader.stats().moved > 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", MODELS)
def test_scope_with_offload_decisions_matches_plain(name: str, policy: remat.Policy) -> None:
    model, batch, blocks = build(name)
    wrapped = twin(model)
    offloader = remat.Offloader()
    for block in blocks(wrapped):
        _in_scope(block, policy, offloader)
    assert_same(train(model, batch), train(wrapped, batch))
    assert offloader.stats().moved > 0


@pytest.mark.parametrize("name", MODELS)
def test_must_cpu_offload_in_context_fn_matches_plain(name: str) -> None:
    def offload_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        heavy = op in (torch.ops.aten.addmm.default, torch.ops.aten.convolution.default)
        return CheckpointPolicy.MUST_CPU_OFFLOAD if heavy else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, offload_matmuls)
    model, batch, blocks = build(name)
    wrapped = twin(model)
    offloader = remat.Offloader()
    for block in blocks(wrapped):
        remat.checkpoint(context_fn=context_fn, offloader=offloader)(block)
    assert_same(train(model, batch), train(wrapped, batch))
    assert offloader.stats().moved > 0


def test_batch_norm_statistics_are_updated_once_with_offload() -> None:
    model, batch, blocks = build("cnn")
    wrapped = twin(model)
    for block in blocks(wrapped):
        remat.checkpoint(block, policy=remat.OffloadComputeIntensive())
    train(model, batch, steps=4)
    train(wrapped, batch, steps=4)
    bn, plain_bn = wrapped.get_submodule("layers.0.bn"), model.get_submodule("layers.0.bn")
    assert bn.num_batches_tracked.item() == 4
    assert torch.equal(bn.running_mean, plain_bn.running_mean)
    assert torch.equal(bn.running_var, plain_bn.running_var)


def test_a_second_backward_over_a_retained_graph_gets_the_same_gradients() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with remat.offload(prefetch=1):
        loss = net(x).square().sum()
    first = torch.autograd.grad(loss, list(net.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(net.parameters()))
    expected = torch.autograd.grad(net(x).square().sum(), list(net.parameters()))
    for a, b, c in zip(first, second, expected, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
