"""Tensors C++ code reads or fills outside any op the dispatch mode sees: a packed sequence's
``batch_sizes`` (``aten.READ_OUTSIDE_OPS``) is not the pool's, an ``empty`` op's result is never
evicted (NOTE [unfilled results] in ``remat.core.residency``; ``_pad_packed_sequence`` writes its
lengths so), and a sparse gradient is not the pool's either."""

from __future__ import annotations

import torch
from torch import nn

import remat


class _Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(16, 16, batch_first=True), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([12, 7, 3, 1]), batch_first=True)
        out, (h, _) = self.rnn(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.head(padded).square().mean() + h.square().mean()


def test_a_packed_sequences_batch_sizes_and_empty_results_are_never_evicted() -> None:
    """The packed LSTM reads ``batch_sizes`` through its data pointer for its whole loop, and
    ``pad_packed_sequence`` fills its lengths so between the ops that copy the sequences: evicted,
    the LSTM read garbage lengths (torch's "start (41) + length (32) exceeds dimension size") and
    the lengths were written after their memory was freed (the process aborted: "corrupted
    double-linked list")."""
    torch.manual_seed(0)
    model, x = _Packed(), torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(1))
    model(x).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with remat.dynamic(None, "dtr", keep=model, cost="model") as region:
        model(x).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters(), strict=True))
    trace = region.stats.trace
    pack = next(op for op in trace.ops if op.name.startswith("aten._pack_padded_sequence"))
    assert len(pack.outputs) == 1  # the data; batch_sizes is not the pool's
    assert any(op.name.startswith("aten.empty.") for op in trace.ops)  # pad_packed_sequence's lengths


def test_a_sparse_gradient_is_not_the_pools() -> None:
    """``nn.Embedding(sparse=True)``: marking its sparse gradient wanted at the end read a storage
    sparse tensors do not have (torch's NotImplementedError, the step undone)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32, sparse=True), nn.Linear(32, 32))
    idx = torch.randint(0, 50, (8, 64), generator=torch.Generator().manual_seed(1))
    model(idx).square().mean().backward()
    plain = [p.grad.to_dense() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with remat.dynamic(None, "dtr", keep=model, cost="model"):
        model(idx).square().mean().backward()
    assert all(torch.equal(a, p.grad.to_dense()) for a, p in zip(plain, model.parameters(), strict=True))
