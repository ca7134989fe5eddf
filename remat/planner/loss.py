"""The loss of the step a plan is made for: ``loss_fn(model, *inputs)`` (``**inputs`` for a
mapping), or the model's own output or its ``.loss``, checked to be a scalar that requires grad.

A plan counts and runs the ops of one call of the model (``remat.planner.execute``: its dispatch
mode is pushed when the model's forward starts), so a ``loss_fn`` must call the model once, through
its forward: one that calls only its submodules (``m.head(m.body(x))``) would be planned and then
run nothing (the plain peak, over the budget), and one that calls it twice would be planned for a
call that never runs as traced. Both are refused here, when the step is traced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from remat.planner.search import fail

__all__ = ["Inputs", "LossFn", "step_loss"]

LossFn = Callable[..., torch.Tensor]
Inputs = torch.Tensor | Sequence[Any] | Mapping[str, Any]


def step_loss(model: nn.Module, inputs: Inputs, loss_fn: LossFn | None) -> torch.Tensor:
    """The step's loss (see the module doc)."""
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    calls: list[None] = []
    if loss_fn is not None:
        hook = model.register_forward_pre_hook(lambda *_: calls.append(None))
        try:
            out = loss_fn(model, **inputs) if isinstance(inputs, Mapping) else loss_fn(model, *inputs)
        finally:
            hook.remove()
    else:
        out = model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)
        out = getattr(out, "loss", out)
    if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.requires_grad or out.is_complex():
        given = type(out).__name__
        if isinstance(out, torch.Tensor):  # what is off: its shape, dtype, or a graph to differentiate
            given = f"tensor of shape {list(out.shape)}, {str(out.dtype).removeprefix('torch.')}, "
            given += (
                "requiring grad" if out.requires_grad else "not requiring grad (detached, or of no parameter)"
            )
        off = isinstance(out, torch.Tensor) and not torch.is_grad_enabled()
        raise fail(
            "the step's loss must be a real scalar tensor that requires grad",
            f"got {given}" + (", made with grad disabled (torch.no_grad)" if off else ""),
            "plan outside torch.no_grad()" if off else "pass loss_fn(model, *inputs) returning the loss",
        )
    if loss_fn is not None and len(calls) != 1:
        raise fail(
            "loss_fn calls the model once, through its forward: the plan runs inside that call",
            f"it was called {len(calls)} times"
            + (": loss_fn called its submodules, not the model" if not calls else ""),
            "call model(...) in loss_fn, or plan a module whose one call is the step's forward "
            "(wrap two calls of the model in one nn.Module)",
        )
    return out
