"""Offload on a GPU, in every form: pinned host buffers and a side stream, and still exactly what the
plain model computes (losses, every gradient, buffers, the RNG stream) on GPT-2, BERT and a CNN with
batch norm, with the device's peak lower than the plain step's in the allocator's count
(``torch.cuda.max_memory_allocated``). Deterministic kernels, so that two plain runs agree bit for
bit (embedding's backward sums with atomics otherwise)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch
from models import assert_same, build, loss_of, train, twin
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat.planner import trace_step
from remat.planner.api import plan_at
from remat.planner.frontier import frontier
from remat.planner.offload_search import offload_frontier

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

MODELS = ["gpt2", "bert", "cnn"]
FAST = remat.Link(d2h=1e18, h2d=1e18, latency=0)
Batch = Callable[[int], dict[str, Any]]


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def on_cuda(name: str) -> tuple[nn.Module, Batch, Callable[[nn.Module], list[nn.Module]]]:
    model, batch, blocks = build(name)

    def cuda_batch(step: int) -> dict[str, Any]:
        return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch(step).items()}

    return model.cuda(), cuda_batch, blocks


def peak(model: nn.Module, inputs: dict[str, Any], region: Callable[[], Any] | None = None) -> int:
    """The allocator's peak over one step beyond what was allocated before it."""
    model.zero_grad(set_to_none=True)
    with remat.memory.track("cuda") as tracked:
        with region() if region is not None else nullcontext():
            loss = loss_of(model(**inputs))
        loss.backward()
    return tracked.peak_bytes


@pytest.mark.parametrize("name", MODELS)
def test_the_offload_region_on_cuda_matches_plain_and_lowers_the_peak(name: str) -> None:
    model, batch, _ = on_cuda(name)
    made: list[remat.Offloader] = []

    @contextmanager
    def region() -> Iterator[None]:
        with remat.offload(prefetch=2) as offloader:
            made.append(offloader)
            yield

    wrapped = twin(model)
    assert_same(train(model, batch), train(wrapped, batch, region=region))
    assert all(o.stats().moved > 0 and o.stats().bytes_back == o.stats().bytes_out for o in made)
    assert peak(wrapped, batch(0), region) < peak(model, batch(0))


def _scoped(block: nn.Module, policy: remat.Policy, offloader: remat.Offloader) -> None:
    forward = block.forward

    @functools.wraps(forward)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with remat.scope(policy, offloader=offloader):
            return forward(*args, **kwargs)

    block.forward = scoped  # type: ignore[method-assign]


def _offload_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    heavy = op in (torch.ops.aten.addmm.default, torch.ops.aten.convolution.default)
    return CheckpointPolicy.MUST_CPU_OFFLOAD if heavy else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("form", ["checkpoint", "scope", "context_fn"])
@pytest.mark.parametrize("name", MODELS)
def test_the_manual_forms_with_offload_decisions_on_cuda_match_plain(name: str, form: str) -> None:
    model, batch, blocks = on_cuda(name)
    wrapped = twin(model)
    offloader = remat.Offloader(prefetch=1)
    policy = remat.OffloadLarger(1024)
    context_fn = functools.partial(create_selective_checkpoint_contexts, _offload_matmuls)
    for block in blocks(wrapped):
        if form == "checkpoint":
            remat.checkpoint(block, policy=policy, offloader=offloader)
        elif form == "scope":
            _scoped(block, policy, offloader)
        else:
            remat.checkpoint(context_fn=context_fn, offloader=offloader)(block)
    assert_same(train(model, batch), train(wrapped, batch))
    assert offloader.stats().moved > 0


@pytest.mark.parametrize("name", MODELS)
def test_an_applied_three_way_plan_on_cuda_matches_plain_and_lowers_the_peak(name: str) -> None:
    """Halfway between recomputation's smallest peak and the plain one, over a link that costs
    nothing, the plan offloads; it computes what the plain step does, with a lower peak in the
    allocator's count. (The prediction assumes copies that take no time, which real ones do not:
    its peak is checked over a measured link below.)"""
    model, batch, _ = on_cuda(name)
    trace = trace_step(model, batch(0), repeats=1)
    alone = frontier(trace, "auto")
    low = min(c.pred.peak_bytes for c in alone.candidates)
    plan = plan_at(offload_frontier(alone, FAST, None, "offload_greedy"), (low + alone.baseline) // 2)
    assert plan.offloaded_bytes > 0
    planned = twin(model)
    assert_same(
        train(model, batch, steps=2), train(planned, batch, steps=2, region=lambda: plan.apply(planned))
    )
    assert peak(planned, batch(0), lambda: plan.apply(planned)) < peak(model, batch(0))


def test_a_three_way_plan_over_the_measured_link_holds_its_predicted_peak() -> None:
    """GPT-2 small (random weights) over the link measured here, at the peak of recomputation's
    plan halfway to the plain peak: the three-way plan offloads, its gradients are those of the
    plain step bit for bit, and the allocator's peak is within 2% of the prediction (on an H100 it
    was 1.5% over: 818.4 MB against 806.5; when a copy ends is the link model's guess)."""
    wl = remat.zoo.build("gpt2", device="cuda", batch=2, seq=256)
    model = wl.model

    def loss(m: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
        return wl.loss_fn(m(*inputs))

    trace = trace_step(model, wl.inputs, loss, repeats=1)
    alone = frontier(trace, "auto")
    low = min(c.pred.peak_bytes for c in alone.candidates)
    recompute = plan_at(alone, (low + alone.baseline) // 2)
    plan = plan_at(offload_frontier(alone, remat.Link.measure()), recompute.predicted_peak_bytes)
    assert plan.offloaded_bytes > 0, plan

    def step(region: Callable[[], Any]) -> tuple[int, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with remat.memory.track("cuda") as tracked:
            with region():
                out = loss(model, *wl.inputs)
            out.backward()
        return tracked.peak_bytes, [p.grad.clone() for p in model.parameters()]

    plain_peak, plain_grads = step(nullcontext)
    planned_peak, planned_grads = step(lambda: plan.apply(model))
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, planned_grads, strict=True))
    assert planned_peak <= plan.predicted_peak_bytes * 1.02, (planned_peak, plan.predicted_peak_bytes)
    assert planned_peak < plain_peak


def _forward_leaves(net: nn.Module, x: torch.Tensor, region: Any) -> tuple[int, remat.Offloader | None]:
    """Bytes the forward leaves on the device for backward, once the copies out have finished
    (an allocation after the synchronize lets the caching allocator take back the blocks whose
    copies were pending on the side stream)."""
    with remat.memory.track("cuda") as tracked:
        with region as offloader:
            loss = net(x).square().sum()
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")
    del loss
    return tracked.current_bytes, offloader


def test_on_cuda_the_forward_leaves_less_by_exactly_the_bytes_moved() -> None:
    torch.manual_seed(0)
    width = 256
    net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)]).cuda()
    x = torch.randn(width, width, device="cuda")
    plain, _ = _forward_leaves(net, x, nullcontext())
    left, offloader = _forward_leaves(net, x, remat.offload())
    assert offloader is not None
    moved = offloader.stats().bytes_out
    assert moved == 4 * width * width * 4  # the four tanh outputs (each also a linear's input)
    assert plain - left == moved
