"""``remat.scope`` moves an OFFLOAD value to host memory only when something will read it back
(autograd saves it, or an op that may replay reads it): a value nothing reads never crosses the
link, and the gradients stay those of the plain block."""

from __future__ import annotations

import torch
from torch import nn

import remat


def _block() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))


def _grads(block: nn.Sequential, x: torch.Tensor, offloader: remat.Offloader | None) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    if offloader is None:
        out = block(x)
    else:
        with remat.scope(remat.OffloadOps(frozenset({"aten.addmm.default"})), offloader=offloader):
            out = block(x)
    (out * out).sum().backward()  # outside the region: autograd's own saves are not the scope's
    grads = [x.grad, *(p.grad for p in block.parameters())]
    block.zero_grad(set_to_none=True)
    return [g.clone() for g in grads if g is not None]


def test_an_offload_value_nothing_reads_back_stays_on_the_device() -> None:
    block, x = _block(), torch.randn(8, 32)
    offloader = remat.Offloader(prefetch=0)
    plain, scoped = _grads(block, x, None), _grads(block, x, offloader)
    assert all(torch.equal(a, b) for a, b in zip(plain, scoped, strict=True))
    stats = offloader.stats()
    # the first addmm's output (8 x 48 floats) moves: ReLU's replay reads it; the second's is the
    # region's output, which no op of the region reads and autograd saves outside it
    assert (stats.moved, stats.bytes_out) == (1, 8 * 48 * 4)
    assert stats.bytes_back == stats.bytes_out
