"""What a recomputation runs and keeps, against ``torch.utils.checkpoint`` in the allocator's count:
it stops at the last save (NOTE [early stop] in ``remat.manual.early_stop``), and it keeps nothing
for a saved tensor whose autograd node died in the forward (NOTE [dead handles] in
``remat.manual.handles``). Gradients are compared bit for bit with the plain blocks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat

H = 64


class _Gated(nn.Module):
    """``x + out(tanh(a(x)) * gate)`` with the gate cut from the graph: detached into a new tensor,
    in place (its sigmoid's node, and the output it saved, die at once), or not at all."""

    def __init__(self, cut: str) -> None:
        super().__init__()
        self.a, self.g, self.out, self.cut = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H), cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.g(x))
        if self.cut == "detach_":
            gate.detach_()
        elif self.cut == "detach":
            gate = gate.detach()
        return x + self.out(torch.tanh(self.a(x)) * gate)


class _Mlp(nn.Module):
    """A residual MLP whose last op with saves is a linear layer (a Llama layer's ``down_proj``)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(x)))


BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "linear last": _Mlp,
    "gate detached in place": lambda: _Gated("detach_"),
    "gate detached": lambda: _Gated("detach"),
    "gate in the graph": lambda: _Gated("none"),
}


def _run(blocks: nn.ModuleList, x: torch.Tensor, form: str) -> torch.Tensor:
    h = x
    for block in blocks:
        if form == "torch":
            h = torch_checkpoint.checkpoint(block, h, use_reentrant=False)
        elif form == "checkpoint":
            h = remat.checkpoint(block, h)
        elif form == "scope":
            with remat.scope():
                h = block(h)
        else:
            h = block(h)
    return h.pow(2).sum()


class _Matmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
        return func(*args, **(kwargs or {}))


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    """Equal bit for bit, or both None (the gate's linear layer gets no gradient once cut)."""
    return all(
        x is y is None or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _step(name: str, form: str) -> tuple[int, int, list[torch.Tensor | None]]:
    """The allocator's peak of one step, the matrix products its backward runs, the gradients."""
    torch.manual_seed(0)
    blocks = nn.ModuleList([BLOCKS[name]() for _ in range(3)])
    x = torch.randn(128, H, requires_grad=True)
    with remat.memory.track(allocator=True) as tracked:
        loss = _run(blocks, x, form)
        with _Matmuls() as matmuls:
            loss.backward()
    return tracked.peak_bytes, matmuls.count, [x.grad, *(p.grad for p in blocks.parameters())]


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_the_checkpoint_recomputes_what_torch_recomputes_and_keeps_no_more(name: str) -> None:
    """The recomputation stopped only at the end of the function where the last op saved its
    arguments (a linear layer's input and weight, a product's inputs): the last matmul ran again
    for nothing, and its output and the residual sum took memory. And a handle whose node died
    (a gate detached) had its tensor kept to the end of the backward."""
    peak, matmuls, grads = _step(name, "checkpoint")
    torch_peak, torch_matmuls, torch_grads = _step(name, "torch")
    plain_grads = _step(name, "plain")[2]
    assert _same(grads, plain_grads) and _same(torch_grads, plain_grads)
    assert matmuls == torch_matmuls
    assert peak <= torch_peak


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_a_scope_keeps_no_value_for_a_handle_autograd_let_go_of(name: str) -> None:
    """A scope replayed the value of every handle it gave out and cached it until its unpack; the
    sigmoid's saved output, whose node ``detach_`` freed, is never unpacked and stayed cached to
    the end of the backward (a whole activation above ``torch.utils.checkpoint``)."""
    peak, _, grads = _step(name, "scope")
    torch_peak = _step(name, "torch")[0]
    plain_grads = _step(name, "plain")[2]
    assert _same(grads, plain_grads)
    assert peak <= torch_peak
