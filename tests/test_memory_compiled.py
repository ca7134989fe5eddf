"""``remat.memory.track`` around a ``replay="compiled"`` region: counting tensors (a dispatch mode)
keeps Dynamo from compiling, which is said in one warning; the gradients stay the plain ones."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import remat


def test_compiled_replay_under_counting_warns_once_and_keeps_gradients() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(11, 29), nn.GELU(approximate="tanh"), nn.Linear(29, 11)
    )  # shapes of its own
    h = torch.randn(7, 11, requires_grad=True)
    (h + mlp(h)).sum().backward()
    expected = [t.grad.clone() for t in (h, *mlp.parameters())]  # type: ignore[union-attr]
    for t in (h, *mlp.parameters()):
        t.grad = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with remat.memory.track() as m:
            with remat.scope(replay="compiled"):
                y = h + mlp(h)
            y.sum().backward()
    ours = [str(w.message) for w in caught if "remat" in str(w.message)]
    assert len(ours) == 1, ours
    assert ours[0].startswith("remat.memory.track: 1 compiled replay run(s) replayed op by op")
    assert "allocator=True" in ours[0] and caught[0].filename == __file__
    assert m.peak_bytes > 0
    for want, t in zip(expected, (h, *mlp.parameters()), strict=True):
        torch.testing.assert_close(t.grad, want)
