"""Offload where the program is not a plain chain of fresh tensors: a result on its argument's
storage (``_unsafe_view``), sparse tensors under a policy, a saved tensor the program still holds;
and arguments that only look like numbers."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import remat
from remat.policy import Decision, OpContext


@pytest.mark.parametrize("shape", [(128, 64), (4, 32, 64)])
def test_a_linear_on_a_3d_input_offloads_its_matmul(shape: tuple[int, ...]) -> None:
    """A bias-free linear on a 3-D input runs ``mm`` then ``_unsafe_view`` on its storage: the
    storage keeps the ``mm``'s decision (the view's, RECOMPUTE, replaced it, and nothing moved)."""
    torch.manual_seed(0)
    lin, x = nn.Linear(64, 256, bias=False), torch.randn(*shape)
    with remat.offload(remat.OffloadOps({"aten.mm"})) as offloaded:
        loss = nn.functional.gelu(lin(x)).sum()  # gelu saves the linear's output
    loss.backward()
    assert (offloaded.stats().moved, offloaded.stats().bytes_out) == (1, 128 * 256 * 4)


class _OffloadAll:
    def decide(self, ctx: OpContext) -> Decision:
        return Decision.OFFLOAD


def _sparse_product(w: torch.Tensor) -> torch.Tensor:
    return torch.sparse.mm((torch.eye(8) * 2.0).to_sparse(), w * 3)


@pytest.mark.parametrize("form", ["checkpoint", "scope"])
def test_sparse_tensors_under_a_policy_are_kept_or_refused_clearly(form: str) -> None:
    """A policy that keeps a sparse result keeps it; one that offloads it gets remat's error (both
    crashed in torch, reading the size of a storage a sparse tensor has not)."""

    def run(policy: remat.Policy) -> torch.Tensor:
        w = torch.randn(8, 8, requires_grad=True)
        if form == "checkpoint":
            out = remat.checkpoint(_sparse_product, w, policy=policy)
        else:
            with remat.scope(policy):
                out = _sparse_product(w)
        out.sum().backward()
        assert w.grad is not None
        return w.grad

    assert torch.equal(run(remat.SaveComputeIntensive()), torch.full((8, 8), 6.0))
    with pytest.raises(remat.RematValueError, match=r"cannot be moved to host memory \(a torch.sparse_coo"):
        run(_OffloadAll())


def test_a_saved_tensor_the_program_still_holds_comes_back_as_itself() -> None:
    """Moved out while the caller keeps it (tanh's output, which tanh saves), the tensor itself
    is what backward reads: no copy beside it (the region's peak was 255 KiB above the plain
    step's)."""
    torch.manual_seed(0)
    lin, x = nn.Linear(256, 256), torch.randn(512, 256)

    def step(offload: bool) -> tuple[int, torch.Tensor]:
        lin.zero_grad(set_to_none=True)
        with remat.memory.track(timeline=False, allocator=True) as tracked:
            with remat.offload(prefetch=0) if offload else contextlib.nullcontext():
                h = torch.tanh(lin(x))
            h.sum().backward()
        assert lin.weight.grad is not None
        return tracked.peak_bytes, lin.weight.grad.clone()

    (plain, expected), (moved, got) = step(False), step(True)
    assert torch.equal(got, expected)
    assert moved <= plain


def test_a_policy_class_and_a_bool_or_float_size_are_clear_errors() -> None:
    """The region form checks its policy as the others do (a class gave a bare TypeError from
    ``decide``), and a size of False or 0.0 is no byte count (both read as 0)."""
    refused = pytest.raises(remat.RematTypeError, match=r"remat\.offload: policy .* not its class")
    with refused, remat.offload(policy=remat.OffloadLarger):  # type: ignore[arg-type]
        pass
    for size in (False, 0.0):
        with pytest.raises(remat.RematTypeError, match=rf"remat\.offload: a byte count .*\(got {size}\)"):
            remat.Offloader(min_bytes=size)  # type: ignore[arg-type]
    assert remat.Offloader(min_bytes=0).min_bytes == remat.Offloader(min_bytes="0").min_bytes == 0
