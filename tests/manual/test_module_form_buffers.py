"""``remat.checkpoint(module)`` wraps the module's bound ``forward``: its recomputation calls it with
no ``Module.__call__``, so the module's own buffers must be shielded by name, not by the pre-hook
that shields its children (batch norm's statistics moved twice per step otherwise)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


def _step(model: _Block, form: str, x: torch.Tensor) -> None:
    if form == "bn":
        remat.checkpoint(model.bn)
    elif form == "bn in block":
        remat.checkpoint(model.bn)
        remat.checkpoint(model)
    if form == "bn in scope":
        remat.checkpoint(model.bn)
        with remat.scope():
            y = model(x)
    else:
        y = model(x)
    y.square().sum().backward()


@pytest.mark.parametrize("form", ["bn", "bn in block", "bn in scope"])
def test_a_checkpointed_module_updates_its_buffers_once(form: str) -> None:
    torch.manual_seed(0)
    plain, x = _Block(), torch.randn(2, 4, 8, 8)
    wrapped = copy.deepcopy(plain)
    _step(plain, "plain", x)
    _step(wrapped, form, x)
    for (name, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
