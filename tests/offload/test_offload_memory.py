"""Offload lowers the device-side memory by the bytes it moves, measured by the allocator.

On CPU the "device" is torch's CPU allocator, seen through the profiler
(``remat.memory.track(allocator=True)``); the host pool's buffers are numpy's, which that allocator
never sees. What the forward leaves for backward is lower by exactly the bytes moved out, and the
peak of a whole step by those bytes less what prefetch brings back ahead of time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch
from models import build, loss_of, twin
from torch import nn

import remat

WIDTH = 256


def _chain() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])
    for p in net.parameters():  # gradients exist before the step, so the step allocates none of them
        p.grad = torch.zeros_like(p)
    return net, torch.randn(WIDTH, WIDTH)


def _forward_leaves(net: nn.Module, x: torch.Tensor, ctx: contextlib.AbstractContextManager[Any]) -> int:
    """Bytes the forward leaves allocated for backward (and the loss's 4)."""
    with remat.memory.track(allocator=True) as m, ctx:
        loss = net(x).square().sum()
    del loss
    return m.current_bytes


def _step_peak(net: nn.Module, x: torch.Tensor, ctx: contextlib.AbstractContextManager[Any]) -> int:
    with remat.memory.track(allocator=True) as m:
        with ctx:
            loss = net(x).square().sum()
        loss.backward()
    return m.peak_bytes


def test_the_forward_leaves_less_by_exactly_the_bytes_moved() -> None:
    net, x = _chain()
    plain = _forward_leaves(net, x, contextlib.nullcontext())
    region = remat.offload()
    with remat.memory.track(allocator=True) as m, region as offloader:
        loss = net(x).square().sum()
    del loss
    moved = offloader.stats().bytes_out
    assert moved == 4 * WIDTH * WIDTH * 4  # the four tanh outputs (each also a linear's input)
    assert plain - m.current_bytes == moved


@pytest.mark.parametrize("prefetch", [0, 2])
def test_the_step_peak_is_lower_by_the_bytes_moved_less_those_prefetched(prefetch: int) -> None:
    net, x = _chain()
    plain = _step_peak(net, x, contextlib.nullcontext())
    with remat.memory.track(allocator=True) as m:
        with remat.offload(prefetch=prefetch) as offloader:
            loss = net(x).square().sum()
        loss.backward()
    stats = offloader.stats()
    largest = WIDTH * WIDTH * 4
    assert stats.bytes_back == stats.bytes_out
    # backward holds the tensor it asked for and the prefetched ones, as a plain backward would
    assert m.peak_bytes <= plain - stats.bytes_out + (prefetch + 1) * largest + 4096
    assert m.peak_bytes < plain
    assert stats.host_peak_bytes == stats.bytes_out


@contextlib.contextmanager
def _scoped_blocks(
    blocks: Iterable[nn.Module], policy: remat.Policy, offloader: remat.Offloader
) -> Iterator[None]:
    blocks = list(blocks)
    forwards = [block.forward for block in blocks]
    for block, forward in zip(blocks, forwards, strict=True):

        def scoped(*args: Any, forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            with remat.scope(policy, offloader=offloader):
                return forward(*args, **kwargs)

        block.forward = scoped  # type: ignore[method-assign]
    try:
        yield
    finally:
        for block, forward in zip(blocks, forwards, strict=True):
            block.forward = forward  # type: ignore[method-assign]


@pytest.mark.parametrize("form", ["checkpoint", "scope"])
def test_offload_decisions_leave_less_than_save_decisions_by_the_bytes_moved(form: str) -> None:
    net, x = _chain()
    leaves: dict[str, int] = {}
    moved = 0
    for name, policy in (
        ("save", remat.SaveComputeIntensive()),
        ("offload", remat.OffloadComputeIntensive()),
    ):
        offloader = remat.Offloader()
        if form == "checkpoint":
            wrapped = nn.Sequential(
                *[
                    remat.checkpoint(nn.Sequential(*block), policy=policy, offloader=offloader)
                    for block in net
                ]
            )
            leaves[name] = _forward_leaves(wrapped, x, contextlib.nullcontext())
        else:
            leaves[name] = _forward_leaves(net, x, _scoped_blocks(net, policy, offloader))
        moved = offloader.stats().bytes_out
    assert moved == 4 * WIDTH * WIDTH * 4  # the four linear outputs
    assert leaves["save"] - leaves["offload"] == moved


@pytest.mark.parametrize("name", ["gpt2", "bert", "cnn"])
def test_on_real_models_the_forward_leaves_less_by_exactly_the_bytes_moved(name: str) -> None:
    model, batch, _ = build(name)
    with remat.memory.track(allocator=True) as plain:
        loss = loss_of(model(**batch(0)))
    del loss
    with remat.memory.track(allocator=True) as m, remat.offload() as offloader:
        loss = loss_of(model(**batch(0)))
    del loss
    moved = offloader.stats().bytes_out
    assert moved > 0.9 * plain.current_bytes  # nearly all of it: every activation, mask and view
    assert plain.current_bytes - m.current_bytes == moved


POLICY_PAIRS = {  # a policy that saves some ops' outputs, and one that moves the same outputs instead
    "compute-intensive": (remat.SaveComputeIntensive(), remat.OffloadComputeIntensive()),
    "ops": (
        remat.SaveOps(frozenset({"aten.addmm", "aten.convolution", "aten.gelu"})),
        remat.OffloadOps(frozenset({"aten.addmm", "aten.convolution", "aten.gelu"})),
    ),
}


@pytest.mark.parametrize("pair", POLICY_PAIRS.values(), ids=POLICY_PAIRS.keys())
@pytest.mark.parametrize("form", ["checkpoint", "scope"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "cnn"])
def test_on_real_models_offload_decisions_leave_less_than_save_decisions_by_the_bytes_moved(
    name: str, form: str, pair: tuple[remat.Policy, remat.Policy]
) -> None:
    """Each layer in ``remat.checkpoint`` or ``remat.scope``: the forward under the offload policy
    leaves exactly the bytes it moved less than under the saving one."""
    model, batch, blocks = build(name)
    leaves: list[int] = []
    moved = 0
    for policy in pair:
        wrapped, offloader = twin(model), remat.Offloader()
        if form == "checkpoint":
            for block in blocks(wrapped):
                remat.checkpoint(block, policy=policy, offloader=offloader)
            ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        else:
            ctx = _scoped_blocks(blocks(wrapped), policy, offloader)
        torch.manual_seed(0)
        with remat.memory.track(allocator=True) as m, ctx:
            loss = loss_of(wrapped(**batch(0)))
        del loss
        leaves.append(m.current_bytes)
        moved = offloader.stats().bytes_out
    assert moved > 0
    assert leaves[0] - leaves[1] == moved
