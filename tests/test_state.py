"""``remat._state``: work that runs a model and leaves it as it was, gradients included."""

from __future__ import annotations

import torch
from torch import nn

from remat._state import Leaves, untouched


def test_gradients_held_before_come_back_unchanged_after_backwards_in_several_blocks() -> None:
    """Backward adds into an existing ``.grad`` in place. ``remat.plan`` on CUDA runs a warm-up step
    and the captured one in two blocks with one ``Leaves``: the second block found the leaf noted
    already, left its gradient in place, and backward added into the program's tensor."""
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    held = [(t, t.grad, t.grad.clone()) for t in (x, *model.parameters()) if t.grad is not None]
    assert len(held) == 3
    leaves = Leaves()
    for _ in range(2):
        with untouched([model], leaves):
            model.zero_grad(set_to_none=True)
            leaves.note(model(x).sum()).backward()
    for t, grad, value in held:
        assert t.grad is grad and torch.equal(grad, value)
